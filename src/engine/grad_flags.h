// What the gradients accumulated since the last step hold: per parameter, whether any gradient
// arrived (a parameter without one is left alone by the built-in optimizers, as torch.optim
// leaves a parameter whose .grad is None), and whether any contribution was not finite (such a
// step is skipped unless the model says otherwise). Written by the gradient thread and by the
// API (a gradient view handed out may be written through), read and cleared at each step.
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

namespace rp {

class GradFlags {
  public:
    explicit GradFlags(size_t num_params) : has_grad_(num_params, 0) {}

    struct Snapshot {
        std::vector<uint8_t> has_grad;
        bool nonfinite = false;
    };

    void mark(size_t param) {
        std::lock_guard<std::mutex> lock(mutex_);
        has_grad_[param] = 1;
    }
    void mark_nonfinite() {
        std::lock_guard<std::mutex> lock(mutex_);
        nonfinite_ = true;
    }
    // Whether parameter `param` received a gradient since the last step (any thread).
    bool has(size_t param) const {
        std::lock_guard<std::mutex> lock(mutex_);
        return has_grad_[param] != 0;
    }
    // At a step: what the step's gradients hold; the buffers the next calls fill start clean.
    Snapshot take() {
        std::lock_guard<std::mutex> lock(mutex_);
        Snapshot s{has_grad_, nonfinite_};
        has_grad_.assign(has_grad_.size(), 0);
        nonfinite_ = false;
        return s;
    }
    void clear() { take(); }

  private:
    mutable std::mutex mutex_;
    std::vector<uint8_t> has_grad_;
    bool nonfinite_ = false;
};

} // namespace rp
