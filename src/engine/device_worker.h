// One worker thread per device. Stage jobs are queued to it in pipeline order and run one after
// another; on a GPU the thread only enqueues work, on a CPU "device" it computes.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <ATen/ATen.h>

namespace rp {

class DeviceWorker {
  public:
    explicit DeviceWorker(at::Device device);
    ~DeviceWorker(); // runs the queued jobs, then joins

    DeviceWorker(const DeviceWorker &) = delete;
    DeviceWorker &operator=(const DeviceWorker &) = delete;

    at::Device device() const { return device_; }
    // Jobs must not throw: they report failure through their call's state.
    void submit(std::function<void()> job);

  private:
    void loop();

    at::Device device_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<std::function<void()>> queue_;
    bool stopping_ = false;
    std::thread thread_;
};

} // namespace rp
