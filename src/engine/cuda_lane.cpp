// The GPU lane: four streams per GPU, ordered by CUDA events; pinned host memory for every
// device-to-host copy, so copies in both directions are asynchronous.
#include "engine/device_lane.h"

#include "base/env_switch.h"
#include "base/error.h"

#ifdef RP_HAVE_CUDA
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace rp {
namespace {

using Event = at::cuda::CUDAEvent;

// Weight copies are split into pieces of this size, meant to let an activation upload queued on
// the other stream wait for at most one piece. The traces show it is not enough: an upload
// enqueued while a stage's weights are in flight can still start only when the whole copy ends
// (bench/RESULTS.md, round 16).
constexpr int64_t kChunkBytes = 32 << 20;

// A host thread that waits for an event of the default flags spins on a core until the event
// completes (the CUDA runtime's schedule with fewer contexts than cores): the gradient accumulator
// waits for downloads through most of a backward, on cores the optimizer's threads need. Events
// made with cudaEventBlockingSync put the waiting thread to sleep. RP_EVENT_BLOCKING_SYNC=0
// restores the spinning waits, to measure what this gives.
unsigned event_flags(bool timing) {
    static const bool blocking = env_switch_on("RP_EVENT_BLOCKING_SYNC");
    return (timing ? cudaEventDefault : cudaEventDisableTiming) |
           (blocking ? cudaEventBlockingSync : cudaEventDefault);
}

std::shared_ptr<Event> record(const c10::cuda::CUDAStream &stream) {
    auto e = std::make_shared<Event>(event_flags(/*timing=*/true)); // the record needs timing
    e->record(stream);
    return e;
}

std::shared_ptr<Event> record_untimed(const c10::cuda::CUDAStream &stream) {
    auto e = std::make_shared<Event>(event_flags(/*timing=*/false));
    e->record(stream);
    return e;
}

class CudaLane final : public DeviceLane {
  public:
    explicit CudaLane(at::Device device)
        : device_(device), weights_(c10::cuda::getStreamFromPool(false, device.index())),
          activations_(c10::cuda::getStreamFromPool(true, device.index())),
          compute_(c10::cuda::getStreamFromPool(false, device.index())),
          download_(c10::cuda::getStreamFromPool(true, device.index())) {}

    at::Device device() const override { return device_; }

    void enter() override {
        c10::cuda::set_device(device_.index());
        c10::cuda::setCurrentCUDAStream(compute_);
    }

    void begin_call() override {
        std::lock_guard<std::mutex> lock(mutex_);
        marks_.clear();
        next_call_from_.reset();
        c10::cuda::CUDAGuard guard(device_);
        // One zero event per stream, all recorded now: spans on different streams compare.
        zero_ = record(compute_);
        host_zero_ = Clock::now(); // the stream is idle here: the two clocks start together
    }

    void begin_next_call_uploads() override {
        c10::cuda::CUDAGuard guard(device_);
        auto from = record_untimed(weights_);
        std::lock_guard<std::mutex> lock(mutex_);
        next_call_from_ = std::move(from);
    }

    Transfer upload_weights(const std::vector<at::Tensor> &host, size_t job) override {
        c10::cuda::CUDAStreamGuard guard(weights_);
        const double enqueued = host_ms();
        auto start = record(weights_);
        Transfer t;
        for (const at::Tensor &h : host) {
            // Allocated on the weight stream and marked for compute, so the caching allocator
            // never hands this memory to a later upload while compute still reads it.
            at::Tensor d = at::empty(h.sizes(), h.options().device(device_).pinned_memory(false));
            const int64_t per_chunk = std::max<int64_t>(1, kChunkBytes / h.element_size());
            at::Tensor src = h.reshape(-1), dst = d.view(-1);
            for (int64_t off = 0; off < src.numel(); off += per_chunk) {
                int64_t n = std::min(per_chunk, src.numel() - off);
                dst.narrow(0, off, n).copy_(src.narrow(0, off, n), /*non_blocking=*/true);
            }
            d.record_stream(compute_);
            t.tensors.push_back(d);
            t.landed.push_back(record_untimed(weights_));
        }
        auto end = record(weights_);
        t.ready = end;
        mark("weights", job, start, end, enqueued, bytes_of(host), "weights");
        return t;
    }

    Transfer upload(const Transfer &from, size_t job) override {
        c10::cuda::CUDAStreamGuard guard(activations_);
        if (from.ready)
            std::static_pointer_cast<Event>(from.ready)->block(activations_);
        const double enqueued = host_ms();
        auto start = record(activations_);
        Transfer t;
        int64_t moved = 0; // tensors already on this GPU cost no transfer
        bool from_peer = false;
        for (const at::Tensor &h : from.tensors) {
            if (!h.defined()) {
                t.tensors.push_back(h);
                continue;
            }
            if (h.device() != device_)
                moved += static_cast<int64_t>(h.nbytes());
            at::Tensor d;
            if (h.is_cuda() && h.device() != device_) {
                from_peer = true;
                d = copy_from_peer(h);
            } else {
                d = h.to(device_, /*non_blocking=*/true);
            }
            d.record_stream(compute_);
            t.tensors.push_back(d);
        }
        auto end = record(activations_);
        t.ready = end;
        // A copy from another GPU does not cross the host's PCIe link: a stream of its own in
        // the timing record, so that PCIe figures leave it out.
        mark(from_peer ? "peer_copy" : "activation_upload", job, start, end, enqueued, moved,
             "activations");
        return t;
    }

    void use(const Transfer &transfer) override {
        if (transfer.ready)
            std::static_pointer_cast<Event>(transfer.ready)->block(compute_);
    }

    Transfer download(const std::vector<at::Tensor> &device_tensors, size_t job, Payload payload,
                      std::shared_ptr<void> after) override {
        auto computed = after ? std::static_pointer_cast<Event>(after) : record(compute_);
        c10::cuda::CUDAStreamGuard guard(download_);
        computed->block(download_);
        const double enqueued = host_ms();
        auto start = record(download_);
        Transfer t;
        int64_t moved = 0; // tensors already on the host cost no transfer
        for (const at::Tensor &d : device_tensors) {
            if (!d.defined() || !d.is_cuda()) {
                t.tensors.push_back(d);
                continue;
            }
            at::Tensor h = at::empty(d.sizes(), d.options().device(at::kCPU).pinned_memory(true));
            h.copy_(d, /*non_blocking=*/true);
            d.record_stream(download_);
            t.tensors.push_back(h);
            moved += static_cast<int64_t>(d.nbytes());
        }
        auto end = record(download_);
        t.ready = end;
        mark("download", job, start, end, enqueued, moved,
             payload == Payload::Gradients ? "gradients" : "activations");
        return t;
    }

    // On the calling thread's current stream: the compute stream for the worker thread; for
    // autograd's thread, the stream its backward kernels (and a hook's own) were enqueued on.
    std::shared_ptr<void> mark_compute() override {
        return record_untimed(c10::cuda::getCurrentCUDAStream(device_.index()));
    }

    void wait(const Transfer &transfer) override {
        if (!transfer.ready)
            return;
        const auto &event = std::static_pointer_cast<Event>(transfer.ready);
        if (!watch_)
            event->synchronize();
        else
            poll([&] { return event->query(); });
    }

    void compute_begin(size_t) override {
        compute_enqueued_ = host_ms();
        compute_start_ = record(compute_);
    }
    void compute_end(size_t job) override {
        mark("compute", job, compute_start_, record(compute_), compute_enqueued_);
    }
    void compute_end_ahead(size_t job) override {
        mark("compute", job, compute_start_, record(compute_), compute_enqueued_, -1,
             kRecomputeAhead);
    }

    std::vector<TraceSpan> finish() override {
        c10::cuda::CUDAGuard guard(device_);
        std::shared_ptr<Event> next_call_from;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            next_call_from = next_call_from_;
        }
        for (auto *s : {&weights_, &activations_, &compute_, &download_}) {
            // The weight stream up to the uploads for the next call: that call waits for those.
            // A stream's work through an event of its own: the wait sleeps (event_flags).
            std::shared_ptr<Event> done =
                s == &weights_ && next_call_from ? next_call_from : record_untimed(*s);
            if (!watch_)
                done->synchronize();
            else
                poll([&] { return done->query(); });
        }
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<TraceSpan> spans;
        // Uploads for this call left in flight by the last one, on this call's clock. They are
        // done: they came before this call's own uploads on the weight stream, waited for above.
        for (Mark &m : pending_) {
            const double shift = m.zero->elapsed_time(*zero_);
            const double host_shift =
                std::chrono::duration<double, std::milli>(host_zero_ - m.host_zero).count();
            TraceSpan span{m.what,
                           m.job,
                           m.zero->elapsed_time(*m.start) - shift,
                           m.zero->elapsed_time(*m.end) - shift,
                           m.bytes,
                           m.content,
                           m.enqueued - host_shift};
            span.from_last_call = true;
            spans.push_back(std::move(span));
        }
        pending_.clear();
        for (Mark &m : marks_) {
            if (m.next_call && !m.end->query()) {
                pending_.push_back(std::move(m));
                continue;
            }
            spans.push_back({m.what, m.job, zero_->elapsed_time(*m.start),
                             zero_->elapsed_time(*m.end), m.bytes, m.content, m.enqueued});
        }
        marks_.clear();
        return spans;
    }

  private:
    // `h`, on another GPU, copied to this one on a stream of h's GPU kept for this lane's peer
    // copies. ATen orders a copy between GPUs against both GPUs' current streams (the source's
    // waits for this lane's activation stream, which waited for `h`'s producer; the activation
    // stream waits for the copy), and `h` is marked as in use on the copy's stream, so its GPU
    // does not reuse its memory before the copy has read it.
    at::Tensor copy_from_peer(const at::Tensor &h) {
        const int source = h.device().index();
        auto found = peer_streams_.find(source);
        if (found == peer_streams_.end())
            found =
                peer_streams_.emplace(source, c10::cuda::getStreamFromPool(false, source)).first;
        c10::cuda::CUDAStreamGuard on_source(found->second);
        at::Tensor d = h.to(device_, /*non_blocking=*/true);
        h.record_stream(found->second);
        return d;
    }

    // Until `done()`: the watch between short sleeps (it throws to give up).
    template <class Done> void poll(Done done) {
        while (!done()) {
            watch_();
            std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
    }

    using Clock = std::chrono::steady_clock;
    struct Mark {
        std::string what;
        size_t job;
        std::shared_ptr<Event> start, end;
        double enqueued;
        int64_t bytes;
        const char *content;
        bool next_call;              // an upload for the next call (begin_next_call_uploads)
        std::shared_ptr<Event> zero; // the clocks of the call that enqueued it
        Clock::time_point host_zero;
    };

    double host_ms() const {
        return std::chrono::duration<double, std::milli>(Clock::now() - host_zero_).count();
    }

    void mark(const char *what, size_t job, std::shared_ptr<Event> start,
              std::shared_ptr<Event> end, double enqueued, int64_t bytes = -1,
              const char *content = "") {
        std::lock_guard<std::mutex> lock(mutex_);
        marks_.push_back({what, job, std::move(start), std::move(end), enqueued, bytes, content,
                          next_call_from_ != nullptr, zero_, host_zero_});
    }

    at::Device device_;
    c10::cuda::CUDAStream weights_, activations_, compute_, download_;
    std::mutex mutex_;
    std::shared_ptr<Event> zero_;
    std::shared_ptr<Event> compute_start_;
    double compute_enqueued_ = 0;
    Clock::time_point host_zero_ = Clock::now();
    std::vector<Mark> marks_;
    // Set by begin_next_call_uploads: the weight stream's point after which uploads are the
    // next call's; their marks still in flight at finish() wait in pending_ for the next one.
    std::shared_ptr<Event> next_call_from_;
    std::vector<Mark> pending_;
    std::map<int, c10::cuda::CUDAStream> peer_streams_; // by source GPU; worker thread only
};

} // namespace

std::unique_ptr<DeviceLane> make_cuda_lane(at::Device device) {
    return std::make_unique<CudaLane>(device);
}

} // namespace rp

#else // no CUDA in this libtorch

namespace rp {
std::unique_ptr<DeviceLane> make_cuda_lane(at::Device) {
    fail(ErrorKind::Cuda, "this RoundPipe was built against a libtorch without CUDA");
}
} // namespace rp

#endif
