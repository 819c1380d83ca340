// One worker thread per device. Stage jobs are queued to it in pipeline order and run one after
// another. As a job starts, the next queued job's weight upload is handed to the device's
// uploader thread, so at most two stages of weights live on a device and the next one crosses
// PCIe while this one computes; the uploader enqueues that copy (hundreds of pieces, ~13 ms of
// host time for a 1.4 GB stage) while the worker already enqueues the job's compute, which
// otherwise waited behind it (bench/RESULTS.md, round 17). On a GPU both threads only enqueue
// work; on a CPU "device" the worker computes.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/device_lane.h"

namespace rp {

struct StageJob {
    std::function<void()> prefetch; // starts the weight upload; run() uses its result
    std::function<bool()> ready;    // whether prefetch() would start without waiting
    std::function<void()> run;      // must not throw: failures go to the call's state
    bool prefetched = false;
    std::future<void> prefetch_done; // when the uploader runs prefetch()
};

class DeviceWorker {
  public:
    explicit DeviceWorker(std::unique_ptr<DeviceLane> lane);
    ~DeviceWorker(); // runs the queued jobs, then joins

    DeviceWorker(const DeviceWorker &) = delete;
    DeviceWorker &operator=(const DeviceWorker &) = delete;

    DeviceLane &lane() { return *lane_; }
    // Queues the jobs atomically, so the worker sees each job's successor for prefetching.
    void submit(std::vector<StageJob> jobs);

  private:
    void loop();
    void upload_loop();
    // Hands `prefetch` (which must not throw) to the uploader; the future is ready once it ran.
    std::future<void> upload(std::function<void()> prefetch);

    std::unique_ptr<DeviceLane> lane_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<StageJob> queue_;
    bool stopping_ = false;
    // The uploader's queue: in FIFO order, so uploads reach the weight stream in job order.
    std::mutex upload_mutex_;
    std::condition_variable upload_wake_;
    std::deque<std::packaged_task<void()>> uploads_;
    bool upload_stopping_ = false;
    const bool separate_uploads_; // RP_UPLOAD_THREAD (device_worker.cpp)
    std::thread uploader_;
    std::thread thread_;
};

} // namespace rp
