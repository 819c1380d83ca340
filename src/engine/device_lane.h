// How a stage job moves data to and from its device. On a GPU: four CUDA streams (weight upload,
// activation upload, compute, download) ordered by events, so the worker thread only enqueues and
// the host never waits; on a CPU device every transfer is the identity. Each lane also records
// when its transfers and compute ran, for the timing record.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace rp {

// Tensors plus the marker of when they are ready (a CUDA event on GPUs; null: ready now).
struct Transfer {
    std::vector<at::Tensor> tensors;
    std::shared_ptr<void> ready;
    // Weight uploads: one marker per tensor (tensor i and every one before it have landed), so
    // compute can start on the first layers of a stage while the rest is still on its way.
    // Empty: only `ready`.
    std::vector<std::shared_ptr<void>> landed;
};

// The content of the compute span of a backward's recompute that ran ahead of its gradient: the
// first of a microbatch's two spans, so not a microbatch of its own (stage_times_of).
inline constexpr char kRecomputeAhead[] = "recompute ahead";

// One interval of the timing record, in milliseconds since the lane's call start.
struct TraceSpan {
    std::string what; // "weights", "activation_upload", "compute", "download"
    size_t job = 0;
    double start_ms = 0, end_ms = 0;
    int64_t bytes = -1; // transfers: bytes moved; -1 for compute
    // What a transfer carries: "weights", "activations" or "gradients" (weight gradients);
    // empty for compute, but kRecomputeAhead for a backward's recompute that ran before the
    // microbatch's gradient arrived (DeviceLane::compute_end_ahead).
    std::string content;
    // When the host enqueued the work, on the host clock from the lane's begin_call (-1: not
    // recorded; CPU devices run it as they enqueue it). The gap to start_ms tells a stream that
    // waited on the device (a copy engine busy, an event not yet reached) from a host thread
    // that enqueued late.
    double enqueued_ms = -1;
    // A weight upload for the next call that was still in flight when its call finished: it is
    // reported by the next finish() instead, on that call's clock (so it may start before 0),
    // and `job` is the index it was uploaded under in the call that enqueued it.
    bool from_last_call = false;
};

// Bytes the tensors hold (what an upload of them moves).
inline int64_t bytes_of(const std::vector<at::Tensor> &tensors) {
    int64_t n = 0;
    for (const at::Tensor &t : tensors)
        n += static_cast<int64_t>(t.nbytes());
    return n;
}

// What a download carries, for the timing record.
enum class Payload { Activations, Gradients };

class DeviceLane {
  public:
    virtual ~DeviceLane() = default;
    virtual at::Device device() const = 0;

    // Worker thread start: make the compute stream current for the thread's life.
    virtual void enter() {}
    // Start of a call (caller thread): zero point of the timing record.
    virtual void begin_call() = 0;

    // All on the worker thread:
    // Host weights -> device, on the weight stream, large tensors in pieces (meant to keep
    // activation copies queued meanwhile from waiting for a whole stage; see cuda_lane.cpp).
    virtual Transfer upload_weights(const std::vector<at::Tensor> &host, size_t job) = 0;
    // Host activation (ready after `from.ready`) -> device, on the activation stream.
    virtual Transfer upload(const Transfer &from, size_t job) = 0;
    // Makes the compute stream wait for a transfer.
    virtual void use(const Transfer &transfer) = 0;
    // Device tensors -> pinned host memory on the download stream, after the compute so far or,
    // given `after` (from mark_compute), after only the compute enqueued before that marker.
    virtual Transfer download(const std::vector<at::Tensor> &device_tensors, size_t job,
                              Payload payload = Payload::Activations,
                              std::shared_ptr<void> after = nullptr) = 0;
    // A marker of the compute the calling thread has enqueued so far (a CUDA event on its
    // current stream; null on CPU devices, where compute is done when enqueued). Any thread:
    // autograd calls its hooks on threads of its own.
    virtual std::shared_ptr<void> mark_compute() { return nullptr; }
    // Any thread: blocks until a transfer has landed (for host code that reads its tensors).
    virtual void wait(const Transfer &transfer) = 0;
    // Brackets compute for the timing record: a span per microbatch of a job. A backward that
    // recomputes its stage before the microbatch's gradient has arrived ends that part with
    // compute_end_ahead (a span marked kRecomputeAhead) and brackets the rest anew, so the wait
    // for the gradient between them is not counted as compute.
    virtual void compute_begin(size_t job) = 0;
    virtual void compute_end(size_t job) = 0;
    virtual void compute_end_ahead(size_t job) = 0;

    // Device's last job of a call: the weight uploads that follow are for the next call, which
    // waits for them itself; finish() does not (default: it does, as for every upload).
    virtual void begin_next_call_uploads() {}

    // Caller thread, at the end of a call: waits for everything this lane enqueued (but the
    // uploads for the next call) and returns the call's timing record.
    virtual std::vector<TraceSpan> finish() = 0;

    // Set once, before any call: wait() and finish() then poll instead of blocking and call
    // `watch` while the device is not done; it throws to abandon the wait. Data parallelism on
    // GPUs sets it: a collective whose peer died never completes, and a blocked wait would never
    // return.
    void set_wait_watch(std::function<void()> watch) { watch_ = std::move(watch); }

  protected:
    std::function<void()> watch_;
};

std::unique_ptr<DeviceLane> make_device_lane(at::Device device);

} // namespace rp
