// The round-robin scheduler: the jobs of a call (forward stages, the fused tail, backward
// stages deepest first) go to device (cursor + job) mod G, and the cursor carries across calls so
// the device that ended one call is not the one that starts the next.
#pragma once
#include <memory>
#include <vector>

#include "engine/device_worker.h"
#include "engine/stage_executor.h"

namespace rp {

// One job of the last call, for the timing record.
struct JobTrace {
    size_t job, stage, device;
    JobKind kind;
    std::vector<TraceSpan> spans;
};

class Pipeline {
  public:
    explicit Pipeline(const std::vector<at::Device> &devices);

    size_t num_devices() const { return workers_.size(); }
    at::Device device(size_t i) const { return workers_[i]->lane().device(); }

    // Runs every job of `ctx`, then waits for every device to finish the call's work; rethrows
    // the first job failure after every job has unwound.
    void run(CallContext &ctx);
    const std::vector<JobTrace> &last_trace() const { return trace_; }
    // Every lane's wait watch (DeviceLane::set_wait_watch); before any call.
    void set_wait_watch(const std::function<void()> &watch) {
        for (auto &w : workers_)
            w->lane().set_wait_watch(watch);
    }

  private:
    std::vector<std::unique_ptr<DeviceWorker>> workers_;
    size_t cursor_ = 0;
    std::vector<JobTrace> trace_;
};

} // namespace rp
