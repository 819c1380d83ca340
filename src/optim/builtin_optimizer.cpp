#include "optim/builtin_optimizer.h"

#include <algorithm>

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

// Whether the step's gradient of parameter i is the optimizer's to zero: a lent download is not
// (it goes back to the pinned pool as it is; zeroing it would move 2 of the 22 bytes a parameter
// the pass moves for nothing).
bool owns_grad(const StepArrays &a, size_t i) { return !(i < a.lent.size() && a.lent[i]); }

GradSpan grad_span(const at::Tensor &g) {
    GradSpan span;
    if (g.scalar_type() == at::kBFloat16)
        span.bf16 = bf16_bits(g);
    else
        span.f32 = g.data_ptr<float>();
    return span;
}

} // namespace

void BuiltinOptimizer::step(const StepArrays &a, const OptimizerSettings &s,
                            const ParamDone &done) {
    const std::vector<at::Tensor> &params = a.params;
    const std::vector<size_t> &which = a.which;
    const std::vector<uint8_t> &has_grad = a.has_grad;
    if (steps_.empty())
        steps_.assign(params.size(), 0);
    struct DropSplit { // a split applies to this call only, whatever happens in it
        size_t &param;
        ~DropSplit() { param = kNone; }
    } drop_split{split_param_};
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
        step_adamw(a, s, update, part, done);
    else
        step_sgd(a, s, update, part, done);
}

void BuiltinOptimizer::step_adamw(const StepArrays &a, const OptimizerSettings &s,
                                  const std::vector<bool> &update, const std::vector<size_t> &part,
                                  const ParamDone &done) {
    const std::vector<at::Tensor> &params = a.params, &grads = a.grads, &lives = a.lives;
    const std::vector<AddedRows> &added_rows = a.added_rows;
    if (first_moment_.empty()) {
        first_moment_ = zeros_like_all(params, bf16_state_);
        second_moment_ = zeros_like_all(params, bf16_state_);
        count_state();
    }
    const AdamWHyper h{s.lr, s.beta1, s.beta2, s.eps, s.weight_decay};
    for (size_t i : part) {
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
        } else if (bf16_state_ && publish && i == split_param_ && params[i].dim() == 2 &&
                   split_rows_.size(0) == params[i].size(0)) {
            adamw_update_bf16_state_rows(
                params[i].data_ptr<float>(), grad_span(grads[i]), bf16_bits(first_moment_[i]),
                bf16_bits(second_moment_[i]), 0, params[i].size(0),
                params[i].numel() / params[i].size(0), split_rows_.data_ptr<uint8_t>(), 1, h,
                steps_[i], i, bf16_bits(lives[i]), owns_grad(a, i));
            // Its own copy (split_next_update), so the mask becomes the record of rows done.
            deferred_ = {i, params[i], lives[i], std::move(split_rows_), s, steps_[i]};
            continue; // done when the deferred rows are (finish_deferred_rows)
        } else if (bf16_state_) {
            adamw_update_bf16_state(
                params[i].data_ptr<float>(), grad_span(grads[i]), bf16_bits(first_moment_[i]),
                bf16_bits(second_moment_[i]), params[i].numel(), h, steps_[i], i,
                publish ? bf16_bits(lives[i]) : nullptr, publish && owns_grad(a, i));
        } else {
            adamw_update(params[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                         first_moment_[i].data_ptr<float>(), second_moment_[i].data_ptr<float>(),
                         params[i].numel(), h, steps_[i]);
        }
        if (done)
            done(i, publish);
    }
}

void BuiltinOptimizer::split_next_update(size_t param, at::Tensor rows_now) {
    require(!has_deferred_rows() && rows_now.scalar_type() == at::kByte &&
                rows_now.is_contiguous() && rows_now.dim() == 1,
            "a split update while another has rows left, or a row mask that is not uint8");
    split_param_ = param;
    split_rows_ = rows_now.ne(0).to(at::kByte);
}

void BuiltinOptimizer::update_deferred(const at::Tensor &rows_done, int64_t row_begin,
                                       int64_t row_end) {
    const DeferredRows &d = deferred_;
    const OptimizerSettings &s = d.settings;
    const AdamWHyper h{s.lr, s.beta1, s.beta2, s.eps, s.weight_decay};
    const size_t i = d.param;
    adamw_update_bf16_state_rows(
        d.master.data_ptr<float>(), GradSpan(), bf16_bits(first_moment_[i]),
        bf16_bits(second_moment_[i]), row_begin, row_end, d.master.numel() / d.master.size(0),
        rows_done.data_ptr<uint8_t>(), 0, h, d.step, i, bf16_bits(d.live), false);
}

void BuiltinOptimizer::serve_deferred_rows(const at::Tensor &needed) {
    if (!has_deferred_rows())
        return;
    // Done for this pass: every row but those needed and not yet updated.
    const at::Tensor skip = needed.eq(0).logical_or(deferred_.rows_done).to(at::kByte);
    update_deferred(skip, 0, skip.size(0));
    deferred_.rows_done.bitwise_or_(needed.ne(0).to(at::kByte));
}

bool BuiltinOptimizer::finish_deferred_rows(const ParamDone &done, int64_t max_rows) {
    if (!has_deferred_rows())
        return true;
    DeferredRows &d = deferred_;
    const int64_t rows = d.rows_done.size(0);
    const int64_t end = max_rows > 0 ? std::min(rows, d.next_row + max_rows) : rows;
    update_deferred(d.rows_done, d.next_row, end);
    d.rows_done.narrow(0, d.next_row, end - d.next_row).fill_(1);
    d.next_row = end;
    if (end < rows)
        return false;
    const size_t i = d.param;
    deferred_ = DeferredRows();
    if (done)
        done(i, true);
    return true;
}

void BuiltinOptimizer::step_sgd(const StepArrays &a, const OptimizerSettings &s,
                                const std::vector<bool> &update, const std::vector<size_t> &part,
                                const ParamDone &done) {
    const std::vector<at::Tensor> &params = a.params, &grads = a.grads;
    // Like torch, a momentum buffer starts as the first gradient it sees, which may be after
    // momentum was switched on between steps, or at a parameter's first gradient.
    const bool momentum = s.momentum != 0.0;
    if (momentum && first_moment_.empty()) {
        first_moment_ = zeros_like_all(params, bf16_state_);
        count_state();
        seeded_.assign(params.size(), 0);
    }
    const SgdHyper h{s.lr, s.momentum, s.weight_decay};
    for (size_t i : part) {
        // Memory-saving mode writes the weight copy and zeroes the gradient in the update's pass,
        // as AdamW's does (a lent download is not zeroed).
        const bool publish = update[i] && bf16_state_ && !a.lives.empty() && a.lives[i].defined();
        if (update[i]) {
            const bool seed = momentum && !seeded_[i];
            if (bf16_state_)
                sgd_update_bf16_state(params[i].data_ptr<float>(), grad_span(grads[i]),
                                      momentum ? bf16_bits(first_moment_[i]) : nullptr,
                                      params[i].numel(), h, seed, steps_[i], i,
                                      publish ? bf16_bits(a.lives[i]) : nullptr,
                                      publish && owns_grad(a, i));
            else
                sgd_update(params[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                           momentum ? first_moment_[i].data_ptr<float>() : nullptr,
                           params[i].numel(), h, seed);
            if (momentum)
                seeded_[i] = 1;
        }
        if (done)
            done(i, publish);
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
