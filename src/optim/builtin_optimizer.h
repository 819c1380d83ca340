// State and update rule of a built-in optimizer (AdamW or SGD) over fp32 master weights.
#pragma once
#include <vector>

#include <ATen/ATen.h>

namespace rp {

enum class OptimizerKind { AdamW, Sgd };

struct OptimizerSettings {
    OptimizerKind kind = OptimizerKind::AdamW;
    double lr = 1e-3;
    double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
    double weight_decay = 1e-2;
    double momentum = 0.0;
};

class BuiltinOptimizer {
  public:
    explicit BuiltinOptimizer(OptimizerKind kind) : kind_(kind) {}
    OptimizerKind kind() const { return kind_; }

    // Updates `params` in place from `grads` (both fp32, contiguous, CPU). Runs on the optimizer
    // thread; state is allocated at the first step.
    void step(const std::vector<at::Tensor> &params, const std::vector<at::Tensor> &grads,
              const OptimizerSettings &settings);

  private:
    OptimizerKind kind_;
    int64_t steps_ = 0;
    std::vector<at::Tensor> first_moment_;  // AdamW exp_avg, SGD momentum buffer
    std::vector<at::Tensor> second_moment_; // AdamW exp_avg_sq
};

} // namespace rp
