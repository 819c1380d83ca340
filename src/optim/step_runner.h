// The optimizer thread: runs queued steps in order, in the background of the pipeline.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace rp {

class StepRunner {
  public:
    // `beside_whole_calls`: standard mode, where each step runs beside the whole next call
    // (host_threads.h, optimizer_thread_count).
    explicit StepRunner(bool beside_whole_calls);
    ~StepRunner(); // drains the queue, then joins

    StepRunner(const StepRunner &) = delete;
    StepRunner &operator=(const StepRunner &) = delete;

    // Queues `task`; it is step number completed() + queued + 1. A throwing task is recorded
    // (see take_error) and counts as completed.
    void submit(std::function<void()> task);
    // Blocks until `count` tasks have completed.
    void wait_for(int64_t count);
    // The first error of a task since the last call, or null.
    std::exception_ptr take_error();
    bool on_this_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  private:
    void loop(bool beside_whole_calls);

    std::mutex mutex_;
    std::condition_variable wake_;
    std::condition_variable done_;
    std::deque<std::function<void()>> queue_;
    int64_t completed_ = 0;
    bool stopping_ = false;
    std::exception_ptr error_;
    std::thread thread_;
};

} // namespace rp
