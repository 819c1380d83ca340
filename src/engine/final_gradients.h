// Sends a tail or backward job's weight gradients to the host as they become final.
//
// A stage's weight gradients are final once its last microbatch has been back-propagated. To
// keep the end of a call from waiting for a whole stage's download and host accumulation, each
// trainable leaf gets a post-accumulation hook for that last backward. Autograd calls it as soon
// as the leaf's gradient is final, on its own thread, while it is still enqueueing the kernels
// of the layers below; the hook flags any inf or nan in the gradient (the non-finite check) and,
// once a group of about kGroupBytes is final, enqueues the group's download behind a marker of the
// compute so far. The host must not wait for the backward to return first: the CPU is not always
// ahead of the GPU at that point (an embedding's backward reads a count back from the device), and
// the downloads would then all start after the last kernel.
#pragma once
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "engine/device_lane.h"
#include "engine/stage_executor.h"

namespace rp {

// Row gradients (an embedding's rows, LayerContext::row_gradients) do not wait for the last
// microbatch: after each earlier one, the rows the job's leaves hold so far go to the host (a
// download behind the compute so far, added there as it lands) and the leaves' gradients are
// cleared, so that only the last microbatch's rows are left for the call's end. Dense
// gradients stay on the device, accumulating, until they are final. Called by a job after each
// microbatch `m`; does nothing after the last or when the call takes no row gradients.
void send_row_gradients(CallContext &ctx, const std::vector<std::pair<size_t, at::Tensor>> &leaves,
                        DeviceLane &lane, size_t job, size_t m);

class FinalGradients {
  public:
    // `leaves`: (parameter index, device leaf) of the job's trainable weights; they must outlive
    // this object, which removes its hooks when destroyed.
    FinalGradients(CallContext &ctx, const std::vector<std::pair<size_t, at::Tensor>> &leaves,
                   DeviceLane &lane, size_t job);
    ~FinalGradients();
    FinalGradients(const FinalGradients &) = delete;
    FinalGradients &operator=(const FinalGradients &) = delete;

    // After the backward: the last group, then every other leaf holding a gradient (none in
    // the usual case: a parameter the last microbatch did not reach).
    void finish();

  private:
    // Large enough that a group's download is not dominated by its fixed costs, small enough
    // that a decoder layer of a 1B-class model is a group of its own.
    static constexpr int64_t kGroupBytes = int64_t{64} << 20;

    struct Hook;
    void add(size_t leaf, const at::Tensor &grad, at::Tensor check);
    void flush();
    // GPU data parallelism: replaces the group's gradients and non-finite checks by their
    // averages and sums over the ranks; returns the marker the downloads wait for.
    std::shared_ptr<void> average_over_ranks();

    CallContext &ctx_;
    const std::vector<std::pair<size_t, at::Tensor>> &leaves_;
    DeviceLane &lane_;
    size_t job_;
    std::mutex mutex_;
    std::vector<bool> sent_;
    std::vector<std::pair<size_t, at::Tensor>> grads_; // the group being gathered
    std::vector<at::Tensor> checks_; // one non-finite flag per gradient of the group
    int64_t bytes_ = 0;
};

} // namespace rp
