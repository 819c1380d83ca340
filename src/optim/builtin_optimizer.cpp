#include "optim/builtin_optimizer.h"

#include "base/error.h"
#include "optim/adamw_kernel.h"
#include "optim/sgd_kernel.h"

namespace rp {
namespace {

std::vector<at::Tensor> zeros_like_all(const std::vector<at::Tensor> &params, bool bf16) {
    std::vector<at::Tensor> out;
    for (const at::Tensor &p : params) // undefined (a frozen parameter): no state
        out.push_back(p.defined() ? at::zeros_like(p, bf16 ? at::kBFloat16 : at::kFloat)
                                  : at::Tensor());
    return out;
}

uint16_t *bf16_bits(const at::Tensor &t) { // t: bf16, contiguous
    return reinterpret_cast<uint16_t *>(t.data_ptr<at::BFloat16>());
}

GradSpan grad_span(const at::Tensor &g) {
    GradSpan span;
    if (g.scalar_type() == at::kBFloat16)
        span.bf16 = bf16_bits(g);
    else
        span.f32 = g.data_ptr<float>();
    return span;
}

} // namespace

void BuiltinOptimizer::step(const std::vector<at::Tensor> &params,
                            const std::vector<at::Tensor> &grads, const OptimizerSettings &s,
                            const ParamDone &done, const std::vector<at::Tensor> &lives,
                            const std::vector<uint8_t> &has_grad,
                            const std::vector<size_t> &which,
                            const std::vector<AddedRows> &added_rows,
                            const std::vector<uint8_t> &lent) {
    if (steps_.empty())
        steps_.assign(params.size(), 0);
    std::vector<size_t> all;
    if (which.empty())
        for (size_t i = 0; i < params.size(); ++i)
            all.push_back(i);
    const std::vector<size_t> &part = which.empty() ? all : which;
    std::vector<bool> update(params.size(), false);
    for (size_t i : part)
        update[i] = (i >= has_grad.size() || has_grad[i] != 0) &&
                    params[i].defined(); // undefined: frozen parameters and buffers
    for (size_t i : part)
        steps_[i] += update[i] ? 1 : 0;
    if (kind_ == OptimizerKind::AdamW)
        step_adamw(params, grads, s, lives, update, part, done, added_rows, lent);
    else
        step_sgd(params, grads, s, update, part, done);
}

void BuiltinOptimizer::step_adamw(const std::vector<at::Tensor> &params,
                                  const std::vector<at::Tensor> &grads,
                                  const OptimizerSettings &s, const std::vector<at::Tensor> &lives,
                                  const std::vector<bool> &update,
                                  const std::vector<size_t> &which, const ParamDone &done,
                                  const std::vector<AddedRows> &added_rows,
                                  const std::vector<uint8_t> &lent) {
    if (first_moment_.empty()) {
        first_moment_ = zeros_like_all(params, bf16_state_);
        second_moment_ = zeros_like_all(params, bf16_state_);
        count_state();
    }
    const AdamWHyper h{s.lr, s.beta1, s.beta2, s.eps, s.weight_decay};
    for (size_t i : which) {
        const bool publish = update[i] && !lives.empty() && lives[i].defined();
        GradSpan grad = update[i] ? grad_span(grads[i]) : GradSpan();
        if (update[i] && i < added_rows.size() && added_rows[i].rows.defined()) {
            require(publish && !bf16_state_ && grad.bf16,
                    "rows added to a lent gradient reached an update other than AdamW's publish");
            grad.f32 = added_rows[i].f32.data_ptr<float>();
            grad.f32_rows = added_rows[i].rows.data_ptr<uint8_t>();
            grad.row_width = grads[i].numel() / grads[i].size(0);
        }
        if (!update[i]) {
        } else if (publish && !bf16_state_) {
            adamw_update_publish(params[i].data_ptr<float>(), grad,
                                 first_moment_[i].data_ptr<float>(),
                                 second_moment_[i].data_ptr<float>(), params[i].numel(), h,
                                 steps_[i], bf16_bits(lives[i]));
        } else if (bf16_state_) {
            // A lent download is not zeroed: 2 of the 22 bytes a parameter the pass would move.
            const bool own_grad = !(i < lent.size() && lent[i]);
            adamw_update_bf16_state(params[i].data_ptr<float>(), grad_span(grads[i]),
                                    bf16_bits(first_moment_[i]), bf16_bits(second_moment_[i]),
                                    params[i].numel(), h, steps_[i], i,
                                    publish ? bf16_bits(lives[i]) : nullptr, publish && own_grad);
        } else {
            adamw_update(params[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                         first_moment_[i].data_ptr<float>(), second_moment_[i].data_ptr<float>(),
                         params[i].numel(), h, steps_[i]);
        }
        if (done)
            done(i, publish);
    }
}

void BuiltinOptimizer::step_sgd(const std::vector<at::Tensor> &params,
                                const std::vector<at::Tensor> &grads, const OptimizerSettings &s,
                                const std::vector<bool> &update,
                                const std::vector<size_t> &which, const ParamDone &done) {
    // Like torch, a momentum buffer starts as the first gradient it sees, which may be after
    // momentum was switched on between steps, or at a parameter's first gradient.
    const bool momentum = s.momentum != 0.0;
    if (momentum && first_moment_.empty()) {
        first_moment_ = zeros_like_all(params, bf16_state_);
        count_state();
        seeded_.assign(params.size(), 0);
    }
    const SgdHyper h{s.lr, s.momentum, s.weight_decay};
    for (size_t i : which) {
        if (update[i]) {
            const bool seed = momentum && !seeded_[i];
            if (bf16_state_)
                sgd_update_bf16_state(params[i].data_ptr<float>(), grad_span(grads[i]),
                                      momentum ? bf16_bits(first_moment_[i]) : nullptr,
                                      params[i].numel(), h, seed, steps_[i], i);
            else
                sgd_update(params[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                           momentum ? first_moment_[i].data_ptr<float>() : nullptr,
                           params[i].numel(), h, seed);
            if (momentum)
                seeded_[i] = 1;
        }
        if (done)
            done(i, false);
    }
}

void BuiltinOptimizer::count_state() {
    int64_t bytes = 0;
    for (const auto *state : {&first_moment_, &second_moment_})
        for (const at::Tensor &t : *state)
            if (t.defined())
                bytes += static_cast<int64_t>(t.nbytes());
    state_bytes_ = bytes;
}

} // namespace rp
