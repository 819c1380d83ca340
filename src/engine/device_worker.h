// One worker thread per device. Stage jobs are queued to it in pipeline order and run one after
// another. Before running a job the worker starts the upload of the next queued job's weights,
// so at most two stages of weights live on a device and the next one crosses PCIe while this
// one computes. On a GPU the thread only enqueues work; on a CPU "device" it computes.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
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

    std::unique_ptr<DeviceLane> lane_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<StageJob> queue_;
    bool stopping_ = false;
    std::thread thread_;
};

} // namespace rp
