#include "engine/device_worker.h"

#include <optional>

#include <c10/core/DeviceGuard.h>

namespace rp {

DeviceWorker::DeviceWorker(at::Device device) : device_(device), thread_([this] { loop(); }) {}

DeviceWorker::~DeviceWorker() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
}

void DeviceWorker::submit(std::function<void()> job) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(job));
    }
    wake_.notify_all();
}

void DeviceWorker::loop() {
    // Kernels and allocations default to this worker's device for the thread's whole life.
    std::optional<c10::DeviceGuard> guard;
    if (!device_.is_cpu())
        guard.emplace(device_);
    for (;;) {
        std::function<void()> job;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty())
                return;
            job = std::move(queue_.front());
            queue_.pop_front();
        }
        job();
    }
}

} // namespace rp
