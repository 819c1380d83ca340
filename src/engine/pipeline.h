// The round-robin scheduler: the jobs of a call (forward stages, the fused tail, backward
// stages deepest first) go to device (cursor + job) mod G, and the cursor carries across calls so
// the device that ended one call is not the one that starts the next.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "engine/carried_weights.h"
#include "engine/device_worker.h"
#include "engine/stage_executor.h"

namespace rp {

// One job of the last call, for the timing record.
struct JobTrace {
    size_t job, stage, device;
    JobKind kind;
    std::vector<TraceSpan> spans;
    bool next_call = false;      // an upload for one of the next call's first jobs on the device
    bool from_last_call = false; // such an upload by the last call, in flight when it ended
};

// How many of the next call's first jobs on each device get their weights uploaded during this
// call's last job there (carried_weights.h): the second where the memory cap has room.
constexpr size_t kCarriedJobs = 2;

class Pipeline {
  public:
    explicit Pipeline(const std::vector<at::Device> &devices);

    size_t num_devices() const { return workers_.size(); }
    at::Device device(size_t i) const { return workers_[i]->lane().device(); }

    // Runs every job of `ctx`, then waits for every device to finish the call's work; rethrows
    // the first job failure after every job has unwound.
    void run(CallContext &ctx);
    const std::vector<JobTrace> &last_trace() const { return trace_; }
    // Waits until the uploads for a next call have read their host memory: before the model
    // frees or rewrites it with no call to come.
    void wait_for_next_call_uploads();
    // Every lane's wait watch (DeviceLane::set_wait_watch); before any call.
    void set_wait_watch(const std::function<void()> &watch) {
        for (auto &w : workers_)
            w->lane().set_wait_watch(watch);
    }

  private:
    // Run by device d's last job of the call, after it has enqueued its work: uploads what the
    // next call's first jobs on d will read, into carried_[d] (carried_weights.h).
    std::function<void()> next_call_upload(CallContext &ctx, const std::vector<CallJob> &jobs,
                                           size_t d);

    std::vector<std::unique_ptr<DeviceWorker>> workers_;
    size_t cursor_ = 0;
    std::vector<JobTrace> trace_;
    // Per device, for the next call's first kCarriedJobs jobs there.
    std::vector<std::vector<CarriedWeights>> carried_;
    bool peer_hand_offs_ = false;         // CallContext::peer_hand_offs
};

} // namespace rp
