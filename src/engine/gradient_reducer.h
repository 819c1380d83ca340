// Averages a call's gradient contributions over the data-parallel ranks, overlapped with the
// pipeline: a bucket of parameters is all-reduced as soon as every job that contributes to them
// has finished, while the devices still run the layers below.
//
// Every rank must issue the same collectives in the same order, whatever its stage plan (an
// automatic plan follows each rank's own measured times) and whatever order its downloads land
// in. So the buckets follow the parameters, not the jobs: trainable parameters in descending
// index order (deepest layers first, the order in which backward finishes them), cut after about
// kBucketBytes. A parameter a rank has no gradient for (a caller layer gave none) is reduced as
// zeros; each bucket also carries, per parameter, whether a rank had a gradient, and one number
// that is NaN when any rank's gradients held inf or nan, so every rank reaches the same
// has-gradient flags and the same skip decision.
//
// Not thread-safe: the GradAccumulator calls it under its lock, except reduce().
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "engine/device_lane.h"
#include "engine/param_store.h"

namespace rp {

class DataParallel;

// One download of a stage's gradients: (param, host tensor) pairs readable after `ready`, and
// 0-d sums whose total is inf or nan when any element is.
struct GradientDownload {
    std::vector<std::pair<size_t, at::Tensor>> grads;
    std::vector<at::Tensor> checks;
    Transfer ready;
    DeviceLane *lane = nullptr;
    bool checked = false; // its checks were counted in some bucket
};

class GradientReducer {
  public:
    // About DDP's default bucket: large enough for the all-reduce's bandwidth, small enough
    // that the first bucket starts early.
    static constexpr int64_t kBucketBytes = int64_t{25} << 20;

    explicit GradientReducer(const ParamStore &store) : store_(store) {}

    struct Bucket {
        std::vector<size_t> params;
        std::vector<std::vector<at::Tensor>> parts;          // per param, this rank's gradients
        std::vector<std::shared_ptr<GradientDownload>> downloads; // to wait for
        std::vector<at::Tensor> checks; // of the downloads this bucket is the first to use
    };
    struct Reduced {
        // fp32 sums over the ranks; times `scale` (1 / ranks) they are the averages (left to
        // the accumulator, which multiplies every contribution anyway)
        std::vector<std::pair<size_t, at::Tensor>> grads;
        double scale = 1.0;
        bool nonfinite = false;
    };

    // A training call starts. `jobs_per_param[p]`: how many of its jobs deliver parameter p's
    // gradient (0: p is not trained in this call).
    void begin_call(const std::vector<int> &jobs_per_param);
    void receive(std::shared_ptr<GradientDownload> download);
    // A job has delivered everything it will for these parameters (repeats allowed).
    void job_done(const std::vector<size_t> &params);
    bool next_ready() const;
    bool finished() const { return next_ >= buckets_.size(); }
    void abort() { next_ = buckets_.size(); }
    Bucket take_next();

    // Off the lock: waits for the bucket's downloads, then sums over the ranks.
    Reduced reduce(const Bucket &bucket, DataParallel &dp) const;

  private:
    const ParamStore &store_; // parameter shapes (they never change)
    std::vector<std::vector<size_t>> buckets_;
    size_t next_ = 0;
    std::vector<int> pending_;                   // per param: jobs yet to finish
    std::vector<std::vector<at::Tensor>> parts_; // per param: this call's contributions
    std::vector<std::vector<std::shared_ptr<GradientDownload>>> sources_; // per param
};

} // namespace rp
