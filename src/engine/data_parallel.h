// Data parallelism across processes over libtorch's c10d: each rank runs its own RoundPipe model
// (its own GPUs or CPU devices) on its share of the batch, and the ranks average their gradients
// before every optimizer step (docs/several-machines.md).
//
// Nothing here is home-made: the rendezvous is c10d's TCPStore (torchrun's conventions for
// "env://"), the collectives are c10d's ProcessGroupGloo on host tensors. A collective that does
// not complete within the timeout (a rank died, hung or failed its call) throws, so no rank waits
// forever; after that the ranks' sequences of collectives no longer match, and the group refuses
// all further work rather than pair one rank's gradients with another's unrelated ones.
#pragma once
#include <cstdint>
#include <memory>
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
    static std::unique_ptr<DataParallel> join(const DataParallelOptions &options,
                                              const std::string &name);
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

    struct Group; // the c10d objects, kept out of this header

  private:
    DataParallel(std::unique_ptr<Group> group, int rank, int world_size, bool global_loss,
                 int64_t timeout_ms);
    template <class F> void collective(const char *what, F &&run);

    std::unique_ptr<Group> group_;
    int rank_, world_size_;
    bool global_loss_;
    int64_t timeout_ms_;
    std::string broken_; // why the group may no longer be used; empty: usable
};

} // namespace rp
