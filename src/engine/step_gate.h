// Per-parameter record of the last optimizer step whose result the parameter's weights hold.
// In memory-saving mode there is one weight copy, so an asynchronous step and the next call
// share it: the step updates parameters in order and opens each one as it finishes, and the
// call uploads a stage only once every parameter of the stage is open for the step before it.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace rp {

class StepGate {
  public:
    explicit StepGate(size_t num_params) : opened_(num_params, 0) {}

    // Optimizer thread: parameter `param` (or every parameter) now holds step `step`'s result.
    void open(size_t param, int64_t step) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            opened_[param] = step;
        }
        changed_.notify_all();
    }
    void open_all(int64_t step) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (int64_t &s : opened_)
                s = step;
        }
        changed_.notify_all();
    }

    bool is_open(const std::vector<size_t> &params, int64_t step) const {
        std::lock_guard<std::mutex> lock(mutex_);
        return all_open(params, step);
    }
    void wait(const std::vector<size_t> &params, int64_t step) const {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return all_open(params, step); });
    }

  private:
    bool all_open(const std::vector<size_t> &params, int64_t step) const {
        for (size_t p : params)
            if (opened_[p] < step)
                return false;
        return true;
    }

    mutable std::mutex mutex_;
    mutable std::condition_variable changed_;
    std::vector<int64_t> opened_;
};

} // namespace rp
