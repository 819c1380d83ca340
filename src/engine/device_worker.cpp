#include "engine/device_worker.h"

#include <string>

#include "base/env_switch.h"
#include "base/thread_name.h"

namespace rp {
namespace {

// rp-cuda0, rp-cpu: the worker's thread name; its uploader's adds "-up".
std::string worker_thread_name(const at::Device &device) {
    std::string name = "rp-";
    name += device.is_cuda() ? "cuda" : device.is_cpu() ? "cpu" : "dev";
    if (device.has_index())
        name += std::to_string(device.index());
    return name;
}

// RP_UPLOAD_THREAD=0 enqueues the next job's upload on the worker, before the job at hand, as
// before the uploader existed: to measure what the uploader gives.
bool uploads_on_their_own_thread() { return env_switch_on("RP_UPLOAD_THREAD"); }

} // namespace

DeviceWorker::DeviceWorker(std::unique_ptr<DeviceLane> lane)
    : lane_(std::move(lane)), separate_uploads_(uploads_on_their_own_thread()),
      uploader_([this] { upload_loop(); }), thread_([this] { loop(); }) {}

DeviceWorker::~DeviceWorker() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    thread_.join(); // the worker waits for every upload it handed over
    {
        std::lock_guard<std::mutex> lock(upload_mutex_);
        upload_stopping_ = true;
    }
    upload_wake_.notify_all();
    uploader_.join();
}

void DeviceWorker::submit(std::vector<StageJob> jobs) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (StageJob &j : jobs)
            queue_.push_back(std::move(j));
    }
    wake_.notify_all();
}

std::future<void> DeviceWorker::upload(std::function<void()> prefetch) {
    std::packaged_task<void()> task(std::move(prefetch));
    std::future<void> done = task.get_future();
    {
        std::lock_guard<std::mutex> lock(upload_mutex_);
        uploads_.push_back(std::move(task));
    }
    upload_wake_.notify_all();
    return done;
}

void DeviceWorker::upload_loop() {
    name_this_thread(worker_thread_name(lane_->device()) + "-up");
    lane_->enter();
    for (;;) {
        std::packaged_task<void()> task;
        {
            std::unique_lock<std::mutex> lock(upload_mutex_);
            upload_wake_.wait(lock, [&] { return upload_stopping_ || !uploads_.empty(); });
            if (uploads_.empty())
                return;
            task = std::move(uploads_.front());
            uploads_.pop_front();
        }
        task();
    }
}

void DeviceWorker::loop() {
    name_this_thread(worker_thread_name(lane_->device()));
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
        if (job.prefetch_done.valid())
            job.prefetch_done.wait(); // its upload is enqueued: run() may use it
        else if (!job.prefetched)
            job.prefetch();
        if (next) {
            // After this job's own upload, so the weight stream takes them in job order.
            if (separate_uploads_)
                next->prefetch_done = upload(next->prefetch);
            else
                next->prefetch();
            next->prefetched = true;
        }
        job.run();
    }
}

} // namespace rp
