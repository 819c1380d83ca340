#include "engine/device_worker.h"

namespace rp {

DeviceWorker::DeviceWorker(std::unique_ptr<DeviceLane> lane)
    : lane_(std::move(lane)), thread_([this] { loop(); }) {}

DeviceWorker::~DeviceWorker() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
}

void DeviceWorker::submit(std::vector<StageJob> jobs) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (StageJob &j : jobs)
            queue_.push_back(std::move(j));
    }
    wake_.notify_all();
}

void DeviceWorker::loop() {
    lane_->enter();
    for (;;) {
        StageJob job;
        StageJob *next = nullptr;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty())
                return;
            job = std::move(queue_.front());
            queue_.pop_front();
            // Only this thread pops, and deque::push_back keeps references valid: `next` stays
            // good after the lock is released.
            // A prefetch that would wait (for the optimizer, in memory-saving mode) is left to
            // the job itself, so it cannot hold up the job running now.
            if (!queue_.empty() && !queue_.front().prefetched &&
                (!queue_.front().ready || queue_.front().ready()))
                next = &queue_.front();
        }
        if (!job.prefetched)
            job.prefetch();
        if (next) {
            next->prefetch();
            next->prefetched = true;
        }
        job.run();
    }
}

} // namespace rp
