// Data parallelism across processes over libtorch's c10d: each rank runs its own RoundPipe model
// (its own GPUs or CPU devices) on its share of the batch, and the ranks average their gradients
// before every optimizer step (docs/several-machines.md).
//
// Nothing here is home-made: the rendezvous is c10d's TCPStore (torchrun's conventions for
// "env://"); the collectives are c10d's ProcessGroupGloo on host tensors (control: weights at the
// start, losses, plan checks; and the gradients of CPU-device models) and, for GPU models,
// ProcessGroupNCCL on the gradients in device memory, one group per local GPU index (the job
// that runs on local GPU d of one rank runs on local GPU d of every rank). A collective that does
// not complete within the timeout (a rank died, hung or failed its call) throws, so no rank waits
// forever; after that the ranks' sequences of collectives no longer match, and the group refuses
// all further work rather than pair one rank's gradients with another's unrelated ones.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace rp {

struct DataParallelOptions {
    int world_size = 0; // 0: not data parallel; -1: $WORLD_SIZE
    int rank = -1;      // -1: $RANK
    // "env://" ($MASTER_ADDR, $MASTER_PORT, as torchrun sets them) or "tcp://host:port".
    std::string rendezvous = "env://";
    int64_t timeout_ms = 600000;
    bool global_loss = false; // report each training call's loss as the mean over the ranks
};

// Whether this build can do data parallelism (libtorch's Gloo headers were found).
bool data_parallel_available();

class DataParallel {
  public:
    // Joins the group (blocks until every rank has arrived, at most the timeout). The options
    // are checked first; `name` keeps this model's keys apart from others' on a shared store.
    // `devices`: the model's; GPUs make the gradients reduce on the devices where this build has
    // NCCL.
    static std::unique_ptr<DataParallel> join(const DataParallelOptions &options,
                                              const std::string &name,
                                              const std::vector<at::Device> &devices);
    ~DataParallel();

    int rank() const { return rank_; }
    int world_size() const { return world_size_; }
    bool global_loss() const { return global_loss_; }

    // Host tensors, in place, the same list on every rank: rank 0's values everywhere.
    void broadcast(const std::vector<at::Tensor> &tensors);
    // A contiguous fp32 host tensor, in place: the sum over the ranks.
    void sum(at::Tensor &flat);
    // The mean of `value` over the ranks.
    double mean(double value);
    // Refuses further collectives after one failed (see above).
    void check_usable() const;
    // The mean over the ranks of each value, in place.
    void average(std::vector<double> &values);
    // Fails with `what` in the message unless every rank passes the same `fingerprint`.
    void check_same(uint64_t fingerprint, const std::string &what);

    // GPU models: whether gradients are averaged in device memory (else on the host).
    bool reduces_on_device() const { return device_groups_ > 0; }
    // On the device of `flat` (the current stream's work so far made it): `flat` (the model
    // dtype) averaged and `sums` (float64 non-finite flags) summed over the ranks, in place.
    // Returns a marker (the lanes' event type) of the results being ready; the current stream
    // does not wait.
    std::shared_ptr<void> average_on_device(const at::Tensor &flat, const at::Tensor &sums);
    // After a call's jobs have finished (its downloads waited for the device collectives):
    // forgets them; with `report_failure`, fails if one of them failed.
    void finish_device_collectives(bool report_failure);
    // Any thread, while waiting for the GPUs (the lanes' wait watch): throws rp::Error(Io) when a
    // device collective failed or has not completed within the timeout (a rank died or hung),
    // after asking NCCL to abort the communicators, whose kernels would otherwise spin forever.
    void watch_device_collectives();

    struct Group; // the c10d objects, kept out of this header

  private:
    DataParallel(std::unique_ptr<Group> group, int rank, int world_size, bool global_loss,
                 int64_t timeout_ms);
    template <class F> void collective(const char *what, F &&run);

    std::unique_ptr<Group> group_;
    int rank_, world_size_;
    bool global_loss_;
    int64_t timeout_ms_;
    // Why the group may no longer be used (empty: usable); set by the gradient threads too.
    void mark_broken(const std::string &why);
    [[noreturn]] void fail_collective(const std::string &what_failed);
    std::string why_broken() const;
    mutable std::mutex broken_mutex_;
    std::string broken_;
    size_t device_groups_ = 0;  // NCCL groups, one per local GPU; 0: gradients on the host
    void abort_device_groups(); // once; never blocks the caller
};

} // namespace rp
