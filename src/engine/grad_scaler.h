// Dynamic loss scaling for fp16 models (torch.amp.GradScaler's rule): the loss is multiplied by
// the scale before backward and the gradients divided by it when they are accumulated; a step
// whose gradients hold inf or nan is skipped and halves the scale, and every `growth_interval`
// good steps double it. The step decides on the optimizer thread, so under async steps a new
// scale reaches the training call after the next one: one iteration late, as upstream.
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>

namespace rp {

class GradScaler {
  public:
    GradScaler(double initial_scale, int growth_interval)
        : scale_(initial_scale), growth_interval_(growth_interval) {}

    bool enabled() const { return scale_ > 0; }
    // A new schedule (0: off) with a fresh count of good steps; the skip count is kept. Only
    // while no step is queued (step_may_proceed runs on the optimizer thread).
    void reset(double initial_scale, int growth_interval);
    double scale() const;
    int64_t skipped_steps() const;

    // Optimizer thread, before an update: false when any gradient is not finite, in which case
    // the step must be skipped (the scale is lowered here).
    bool step_may_proceed(const std::vector<at::Tensor> &grads);

  private:
    mutable std::mutex mutex_;
    double scale_;
    int growth_interval_;
    int good_steps_ = 0;
    int64_t skipped_ = 0;
};

} // namespace rp
