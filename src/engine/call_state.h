// Hand-off between the stage jobs of one pipelined call: job j publishes its result for
// microbatch m, job j + 1 waits for it; a backward job also waits for the forward that stores
// its stage's input (it recomputes before its gradient arrives). Also carries the first failure,
// which wakes every waiter so the whole call unwinds instead of deadlocking.
#pragma once
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

#include "engine/device_lane.h"

namespace rp {

// Thrown inside a job whose call was aborted by another job's failure.
struct CallAborted {};

class CallState {
  public:
    // `stage_inputs_given`: the backward stages' inputs are there before the call (a
    // BackwardOnly call's, from its forward call), so nothing waits for them.
    CallState(size_t num_jobs, size_t num_microbatches, size_t num_backward_stages,
              bool stage_inputs_given)
        : slots_(num_jobs, std::vector<std::optional<Transfer>>(num_microbatches)),
          inputs_stored_(num_backward_stages,
                         std::vector<char>(num_microbatches, stage_inputs_given ? 1 : 0)),
          pending_jobs_(num_jobs) {}

    // A training forward has stored backward stage `stage`'s input for `microbatch` in the
    // call's stage_inputs (CallContext), which the caller of this wrote before calling it.
    void stage_input_stored(size_t stage, size_t microbatch) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            inputs_stored_[stage][microbatch] = 1;
        }
        changed_.notify_all();
    }

    // Waits until that input is stored; the caller may then read it.
    void wait_stage_input(size_t stage, size_t microbatch) {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return error_ || inputs_stored_[stage][microbatch] != 0; });
        if (error_)
            throw CallAborted{};
    }

    void put(size_t job, size_t microbatch, Transfer value) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            slots_[job][microbatch] = std::move(value);
        }
        changed_.notify_all();
    }

    // Waits for and removes job `job`'s result for `microbatch`.
    Transfer take(size_t job, size_t microbatch) {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return error_ || slots_[job][microbatch].has_value(); });
        if (error_)
            throw CallAborted{};
        Transfer value = std::move(*slots_[job][microbatch]);
        slots_[job][microbatch].reset();
        return value;
    }

    void fail(std::exception_ptr error) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (!error_)
                error_ = error;
        }
        changed_.notify_all();
    }

    void job_finished() {
        // Notify while holding the lock: once the last job is counted, the caller may return and
        // destroy this object, so nothing of it may be touched after the mutex is released.
        std::lock_guard<std::mutex> lock(mutex_);
        --pending_jobs_;
        changed_.notify_all();
    }

    // Waits until every job has finished; returns the first failure or null.
    std::exception_ptr wait_all() {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return pending_jobs_ == 0; });
        return error_;
    }

  private:
    std::mutex mutex_;
    std::condition_variable changed_;
    std::vector<std::vector<std::optional<Transfer>>> slots_;
    std::vector<std::vector<char>> inputs_stored_; // [backward stage][microbatch]
    size_t pending_jobs_;
    std::exception_ptr error_;
};

} // namespace rp
