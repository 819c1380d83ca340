#include "optim/step_runner.h"

#include <string>

#include "base/host_threads.h"
#include "base/log.h"
#include "base/thread_name.h"

namespace rp {

StepRunner::StepRunner(bool beside_whole_calls)
    : thread_([this, beside_whole_calls] { loop(beside_whole_calls); }) {}

StepRunner::~StepRunner() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
}

void StepRunner::submit(std::function<void()> task) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(task));
    }
    wake_.notify_all();
}

void StepRunner::wait_for(int64_t count) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return completed_ >= count; });
}

std::exception_ptr StepRunner::take_error() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::exception_ptr e = error_;
    error_ = nullptr;
    return e;
}

void StepRunner::loop(bool beside_whole_calls) {
    name_this_thread("rp-optimizer"); // before its OpenMP team exists: the team inherits it
    // The optimizer's parallel loops are OpenMP teams started from this thread only; their size
    // is set here (host_threads.h says how it is chosen). The CPU optimizer shares host memory
    // bandwidth and cores with the weight uploads, the gradient thread and the device workers'
    // kernel launches.
    const int threads = use_optimizer_threads(beside_whole_calls);
    log(LogLevel::Debug, "optimizer: " + std::to_string(threads) + " threads");
    for (;;) {
        std::function<void()> task;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            // Stop only once the queue is empty: destruction drains pending steps.
            wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty())
                return;
            task = std::move(queue_.front());
            queue_.pop_front();
        }
        std::exception_ptr error;
        try {
            task();
        } catch (...) {
            error = std::current_exception();
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (error && !error_)
                error_ = error;
            ++completed_;
        }
        done_.notify_all();
    }
}

} // namespace rp
