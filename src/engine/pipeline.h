// The round-robin scheduler: the jobs of a call (forward stages, the fused tail, backward
// stages deepest first) go to device (cursor + job) mod G, and the cursor carries across calls so
// the device that ended one call is not the one that starts the next.
#pragma once
#include <memory>
#include <vector>

#include "engine/device_worker.h"
#include "engine/stage_executor.h"

namespace rp {

class Pipeline {
  public:
    explicit Pipeline(const std::vector<at::Device> &devices);

    size_t num_devices() const { return workers_.size(); }
    at::Device device(size_t i) const { return workers_[i]->device(); }

    // Runs every job of `ctx` and waits for all of them; rethrows the first job failure after
    // every job has unwound.
    void run(CallContext &ctx);

  private:
    std::vector<std::unique_ptr<DeviceWorker>> workers_;
    size_t cursor_ = 0;
};

} // namespace rp
