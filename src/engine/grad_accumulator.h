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
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
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
    // Caller thread, before a training call's jobs start. `buffers_zero`: every gradient buffer
    // holds zeros now. `factor` multiplies every contribution (1 / loss scale).
    // `jobs_per_param` (data parallel only): per parameter, how many of the call's jobs deliver
    // a gradient of it (job_done says when each has).
    void begin_call(bool buffers_zero, double factor, const std::vector<int> &jobs_per_param = {});
    // Worker threads: (param, host tensor) pairs of one stage, ready after `ready` on `lane`,
    // and `checks`, 0-d host tensors whose sum is the sum of those gradients (inf or nan when
    // any element is), computed on the device so the host need not read them twice.
    void add(std::vector<std::pair<size_t, at::Tensor>> grads, std::vector<at::Tensor> checks,
             Transfer ready, DeviceLane &lane);
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
    };
    void loop();
    void apply(const Item &item);
    void enqueue(Item item); // under the lock: apply now, or hold until the call succeeds
    void reduce_one(std::unique_lock<std::mutex> &lock); // data parallel: the next bucket

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
    GradientReducer reducer_{store_};
    bool reducing_ = false; // a bucket is off the lock, being reduced
    bool stopping_ = false;
    std::thread thread_;
};

} // namespace rp
