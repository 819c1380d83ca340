#include "engine/grad_scaler.h"

#include "kernels/nonfinite.h"

namespace rp {

double GradScaler::scale() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return scale_;
}

int64_t GradScaler::skipped_steps() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return skipped_;
}

void GradScaler::reset(double initial_scale, int growth_interval) {
    std::lock_guard<std::mutex> lock(mutex_);
    scale_ = initial_scale;
    growth_interval_ = growth_interval;
    good_steps_ = 0;
}

bool GradScaler::step_may_proceed(const std::vector<at::Tensor> &grads) {
    bool finite = true;
    for (const at::Tensor &g : grads) {
        if (!g.defined()) // frozen parameters and buffers
            continue;
        // One read of the gradient, no copy or mask the size of it.
        if (kernels::nonfinite_flag(g).item<double>() != 0.0) {
            finite = false;
            break;
        }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!finite) {
        scale_ *= 0.5;
        good_steps_ = 0;
        ++skipped_;
        return false;
    }
    if (++good_steps_ >= growth_interval_) {
        scale_ *= 2.0;
        good_steps_ = 0;
    }
    return true;
}

} // namespace rp
