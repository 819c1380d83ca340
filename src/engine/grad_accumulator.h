// Adds the gradients a call downloads into the model's fp32 gradient buffers on a thread of its
// own, as each stage's download completes, so the host work overlaps the GPU's later stages
// instead of following the call.
//
// A failed call must leave no trace. When the buffers were zero at the call's start (the usual
// one call per step), the first contribution to a parameter is copied in and a failure zeroes
// what was touched: exact. When the call adds to earlier gradients, its contributions are held
// back and applied only once the call has succeeded.
//
// Data parallel (set_data_parallel): the contributions first go through a GradientReducer, which
// averages them over the ranks, bucket by bucket, on this same thread; the averages are then
// added as above.
//
// In-call steps (report_final): once every job that delivers a parameter's gradient has had its
// contribution added, the gradient is final and handed to a listener, which updates the
// parameter while the call goes on.
//
// Standard mode, bf16 models (lend_standard): a parameter's first contribution since its last
// step, when it is whole and the buffer zero, is lent to the store where its download landed
// (ParamStore::lend_grad) instead of widened into the fp32 buffer; a later contribution widens
// it first, except for rows: a tied embedding's LM-head part stays lent and the embedding's rows,
// at the call's end, add into the zero buffer beside it (ParamStore::mark_rows_added).
//
// Row gradients (takes_row_gradients): an embedding's contribution may be a sparse host tensor
// of the rows its tokens used; only those rows are added.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_set>
#include <vector>

#include "engine/device_lane.h"
#include "engine/grad_flags.h"
#include "engine/gradient_reducer.h"
#include "engine/host_timeline.h"
#include "engine/param_store.h"

namespace rp {

class GradAccumulator {
  public:
    GradAccumulator(ParamStore &store, GradFlags &flags, HostTimeline &timeline);
    ~GradAccumulator(); // drains, then joins

    // Before any call: average every contribution over `dp`'s ranks (null: none).
    void set_data_parallel(DataParallel *dp) { dp_ = dp; }
    // Before any call: downloads are lent (to the store in the standard mode, to the listener of
    // report_final for in-call steps) while the store's lent bytes stay within `limit` (pinned
    // staging memory; 0: never).
    void set_lend_limit(int64_t limit) { lend_limit_ = limit; }
    // Caller thread, before a training call's jobs start. `buffers_zero`: every gradient buffer
    // holds zeros now. `factor` multiplies every contribution (1 / loss scale).
    // `jobs_per_param`: per parameter, how many of the call's jobs deliver a gradient of it
    // (data parallel: job_done says when each has).
    void begin_call(bool buffers_zero, double factor, const std::vector<int> &jobs_per_param);
    // Whether this call's contributions may be row gradients (sparse COO host tensors): not
    // when they are averaged over ranks (the reducer's buckets are dense). With in-call steps
    // the rows add into the gradient buffer, which the listener then reads. Caller thread, after
    // begin_call / report_final.
    bool takes_row_gradients();

    // A gradient no later contribution of the call can change.
    struct FinalGradient {
        size_t param;
        bool received;  // some job delivered one (a parameter no microbatch reached has none)
        bool nonfinite; // a contribution held inf or nan
        // Defined: the gradient where its download landed, lent instead of copied into the
        // store's buffer (which was left untouched, so still zero); see report_final.
        at::Tensor landed;
    };
    using FinalFn = std::function<void(std::vector<FinalGradient>)>;
    // Caller thread, after begin_call with zero buffers and before the call's jobs start:
    // calls `fn` on this accumulator's thread with each parameter's gradient once every job of
    // `jobs_per_param` that delivers it has been added (data parallel: once its bucket's
    // average has been). A handed gradient is the listener's: a failing call no longer zeroes
    // it. Until end_call.
    // A gradient one job delivers whole (every parameter but a tied one) is not copied at all:
    // the download is lent as FinalGradient::landed, which spares the host a read and a write of
    // every gradient byte, and the end of the call the copy of the first stage's. Its bytes
    // count as the store's lent bytes until the listener gives them back
    // (ParamStore::count_lent); beyond the lend limit gradients are copied as usual.
    void report_final(const std::vector<int> &jobs_per_param, FinalFn fn);
    // Worker threads: (param, host tensor) pairs of one stage, ready after `ready` on `lane`,
    // and `checks`, 0-d host tensors whose sum is inf or nan when any element of those gradients
    // is (rp::kernels::nonfinite_flag), computed on the device so the host need not read them
    // twice. `interim`: row gradients of an earlier microbatch (send_row_gradients), after
    // which the job delivers these parameters again; in-call steps count only a job's last
    // delivery of a parameter (report_final), so these never make a gradient final.
    void add(std::vector<std::pair<size_t, at::Tensor>> grads, std::vector<at::Tensor> checks,
             Transfer ready, DeviceLane &lane, bool interim);
    // Worker threads: a job has delivered all its gradients of `params` (its trainable leaves).
    void job_done(const std::vector<size_t> &params);
    // Caller thread, after every job of the call has finished: waits for the additions, applies
    // or drops the call. Rethrows a failure of the additions themselves (the call then leaves
    // no trace when the buffers were zero).
    void end_call(bool succeeded);

  private:
    struct Item {
        std::vector<std::pair<size_t, at::Tensor>> grads;
        std::vector<at::Tensor> checks;
        Transfer ready;
        DeviceLane *lane = nullptr; // null: nothing to wait for
        double scale = 1.0;         // times the call's factor (a reduced bucket: 1 / ranks)
        bool nonfinite = false;     // known without the checks (a reduced bucket)
        bool interim = false;       // see add
        // In-call steps: a job has delivered everything it will (its trainable leaves); an
        // item in the queue behind that job's contributions.
        std::optional<std::vector<size_t>> job_done;
    };
    // report_final's bookkeeping, on this accumulator's thread.
    struct FinalTracking {
        FinalFn fn;
        std::vector<int> jobs_left, delivered, jobs; // delivered: last deliveries (see add)
        std::vector<uint8_t> received, nonfinite, handed;
        std::vector<at::Tensor> landed; // lent downloads, until handed
    };
    // In-call steps: whether `grad`, parameter p's only contribution, can be lent as it landed.
    bool may_lend(size_t p, const at::Tensor &grad, const at::Tensor &dst, double factor) const;
    // Standard mode: whether `grad`, the call's first contribution to p, can be lent to the store.
    bool may_lend_standard(size_t p, const at::Tensor &grad, const at::Tensor &dst, double factor);
    void loop();
    void apply(const Item &item);
    void enqueue(Item item); // under the lock: apply now, or hold until the call succeeds
    void reduce_one(std::unique_lock<std::mutex> &lock); // data parallel: the next bucket
    // In-call steps: `item`'s gradients were added (or its job finished); hand what is final.
    void hand_final(const Item &item, bool nonfinite);

    ParamStore &store_;
    GradFlags &flags_;
    HostTimeline &timeline_;
    std::mutex mutex_;
    std::condition_variable changed_;
    std::deque<Item> queue_;
    std::vector<Item> held_; // contributions applied only on success (buffers not zero)
    size_t in_flight_ = 0;
    bool buffers_zero_ = true;
    double factor_ = 1.0;
    std::unordered_set<size_t> touched_; // parameters written during this call
    std::exception_ptr error_;
    DataParallel *dp_ = nullptr;
    int64_t lend_limit_ = 0;
    std::unique_ptr<FinalTracking> final_; // in-call steps: set from report_final to end_call
    GradientReducer reducer_{store_};
    bool reducing_ = false; // a bucket is off the lock, being reduced
    bool stopping_ = false;
    std::thread thread_;
};

} // namespace rp
