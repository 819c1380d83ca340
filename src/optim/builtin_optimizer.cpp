#include "optim/builtin_optimizer.h"

#include "optim/adamw_kernel.h"
#include "optim/sgd_kernel.h"

namespace rp {
namespace {

std::vector<at::Tensor> zeros_like_all(const std::vector<at::Tensor> &params) {
    std::vector<at::Tensor> out;
    for (const at::Tensor &p : params)
        out.push_back(at::zeros_like(p));
    return out;
}

} // namespace

void BuiltinOptimizer::step(const std::vector<at::Tensor> &params,
                            const std::vector<at::Tensor> &grads,
                            const OptimizerSettings &s) {
    ++steps_;
    if (kind_ == OptimizerKind::AdamW) {
        if (first_moment_.empty()) {
            first_moment_ = zeros_like_all(params);
            second_moment_ = zeros_like_all(params);
        }
        for (size_t i = 0; i < params.size(); ++i)
            adamw_update(params[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                         first_moment_[i].data_ptr<float>(), second_moment_[i].data_ptr<float>(),
                         params[i].numel(), {s.lr, s.beta1, s.beta2, s.eps, s.weight_decay},
                         steps_);
        return;
    }
    // SGD: like torch, the momentum buffer starts as the first gradient it sees, which may be
    // after momentum was switched on between steps.
    bool seed_buffer = false;
    if (s.momentum != 0.0 && first_moment_.empty()) {
        first_moment_ = zeros_like_all(params);
        seed_buffer = true;
    }
    for (size_t i = 0; i < params.size(); ++i) {
        float *buf = s.momentum != 0.0 ? first_moment_[i].data_ptr<float>() : nullptr;
        sgd_update(params[i].data_ptr<float>(), grads[i].data_ptr<float>(), buf,
                   params[i].numel(), {s.lr, s.momentum, s.weight_decay}, seed_buffer);
    }
}

} // namespace rp
