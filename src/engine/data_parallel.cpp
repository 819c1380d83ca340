#include "engine/data_parallel.h"

#include <chrono>
#include <cstdlib>

#include "base/error.h"
#include "base/log.h"
#include "base/thread_name.h"

#ifdef RP_HAVE_C10D_GLOO
#include <mutex>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif
#ifdef RP_HAVE_C10D_NCCL
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <thread>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "engine/collective_watch.h"
#endif

namespace rp {
namespace {

int env_int(const char *name, const std::string &why) {
    const char *v = std::getenv(name);
    require(v && *v, "data parallelism: $" + std::string(name) + " is not set (" + why + ")");
    char *end = nullptr;
    long n = std::strtol(v, &end, 10);
    require(*end == '\0' && n >= 0 && n < (1 << 20),
            "data parallelism: $" + std::string(name) + " is '" + v + "', not a count");
    return static_cast<int>(n);
}

struct Address {
    std::string host;
    int port = 0;
};

// "tcp://host:port", or "env://": $MASTER_ADDR and $MASTER_PORT.
Address parse_rendezvous(const std::string &r) {
    Address a;
    if (r == "env://") {
        const char *host = std::getenv("MASTER_ADDR");
        require(host && *host, "data parallelism: rendezvous \"env://\" needs $MASTER_ADDR");
        a.host = host;
        a.port = env_int("MASTER_PORT", "rendezvous \"env://\" needs it");
    } else {
        const std::string scheme = "tcp://";
        require(r.compare(0, scheme.size(), scheme) == 0,
                "data parallelism: rendezvous '" + r +
                    "' is neither \"env://\" nor \"tcp://host:port\"");
        const std::string rest = r.substr(scheme.size());
        const size_t colon = rest.rfind(':');
        require(colon != std::string::npos && colon > 0 && colon + 1 < rest.size(),
                "data parallelism: rendezvous '" + r + "' has no host:port");
        a.host = rest.substr(0, colon);
        if (a.host.size() > 2 && a.host.front() == '[' && a.host.back() == ']')
            a.host = a.host.substr(1, a.host.size() - 2); // [IPv6]
        char *end = nullptr;
        long port = std::strtol(rest.c_str() + colon + 1, &end, 10);
        require(*end == '\0', "data parallelism: rendezvous '" + r + "' has no port number");
        a.port = static_cast<int>(port);
    }
    require(a.port > 0 && a.port < 65536,
            "data parallelism: port " + std::to_string(a.port) + " is outside 1..65535");
    return a;
}

} // namespace

#ifdef RP_HAVE_C10D_GLOO

bool data_parallel_available() { return true; }

struct DataParallel::Group {
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#ifdef RP_HAVE_C10D_NCCL
    std::vector<c10::intrusive_ptr<c10d::ProcessGroupNCCL>> nccl; // per local GPU index
    std::vector<c10::cuda::CUDAStream> after_nccl; // per local GPU: waits for NCCL's results
    CollectiveWatch in_flight; // the call's gradient collectives not yet seen to complete
    std::once_flag aborted;
#endif
};

namespace {

#ifdef RP_HAVE_C10D_NCCL
// SMs a gradient all-reduce may take beside the pipeline's compute (see add_device_groups).
constexpr int kGradientAllReduceMaxCTAs = 4;

// One NCCL group per local GPU index, connected now, while every rank is known to be there (a
// communicator or a connection set up at the first collective waits, without our timeout, for a
// rank that may have died since: NCCL_RUNTIME_CONNECT=0 makes NCCL connect at set-up).
//
// A collective whose peer died never completes: its kernel spins, and with torch's default error
// handling the watchdog only logs the timeout (measured with torch 2.11 and NCCL 2.28 on two
// H200s: the surviving rank's call had not returned 60 s later, with
// TORCH_NCCL_ASYNC_ERROR_HANDLING=2 neither). So the model's waits for the GPUs poll and ask
// watch_device_collectives(), which fails the call after the timeout and aborts the
// communicators. The watchdog's debug dump, which never finished there, is off unless the user
// asks for it.
void add_device_groups(DataParallel::Group &g, const std::vector<at::Device> &devices, int rank,
                       int world, std::chrono::milliseconds timeout) {
    setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", /*overwrite=*/0);
    setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
    for (size_t d = 0; d < devices.size(); ++d) {
        auto options = c10d::ProcessGroupNCCL::Options::create();
        options->timeout = timeout;
#ifdef NCCL_HAS_CONFIG
        // The gradient all-reduces run while the pipeline computes on the same GPU. NCCL's
        // default gives each one many CTAs (one SM each), which spin on the faster rank until the
        // slower one reaches the same gradient group, taking SMs from the compute. A few CTAs still
        // move a gradient group over NVLink well within the backward that hides it. On two H100s
        // (bench/RESULTS.md round 13) the ranks' tokens/s ratio was 0.906 with NCCL's default and
        // 0.943 with at most 4 CTAs, but later runs showed the first two-rank run of a lease slow
        // whatever it ran, so that gain is not yet separated from the runs' order.
        // $NCCL_MIN_CTAS / $NCCL_MAX_CTAS still win: NCCL lets its environment override a
        // communicator's config.
        options->config.minCTAs = 1;
        options->config.maxCTAs = kGradientAllReduceMaxCTAs;
#endif
        auto store = c10::make_intrusive<c10d::PrefixStore>("nccl/" + std::to_string(d), g.store);
        auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
        pg->setBoundDeviceId(devices[d]);
        pg->eagerConnectSingleDevice(devices[d]);
        g.nccl.push_back(pg);
        g.after_nccl.push_back(c10::cuda::getStreamFromPool(false, devices[d].index()));
    }
}
#endif

} // namespace

std::unique_ptr<DataParallel> DataParallel::join(const DataParallelOptions &o,
                                                 const std::string &name,
                                                 const std::vector<at::Device> &devices) {
    const int world = o.world_size < 0 ? env_int("WORLD_SIZE", "world size -1 reads it")
                                       : o.world_size;
    const int rank = o.rank < 0 ? env_int("RANK", "rank -1 reads it") : o.rank;
    require(world >= 1, "data parallelism: the world size is " + std::to_string(world));
    require(rank < world, "data parallelism: rank " + std::to_string(rank) +
                              " is not below the world size " + std::to_string(world));
    require(o.timeout_ms > 0, "data parallelism: the timeout must be positive");
    const Address at = parse_rendezvous(o.rendezvous);
    const auto timeout = std::chrono::milliseconds(o.timeout_ms);

    // Under torchrun the agent hosts the store and every worker is a client (as
    // torch.distributed's own "env://" handler does); otherwise rank 0 hosts it.
    const char *agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    const bool agent_store = o.rendezvous == "env://" && agent && std::string(agent) == "True";
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(at.port);
    so.isServer = rank == 0 && !agent_store;
    so.numWorkers = static_cast<size_t>(world);
    so.waitWorkers = false;
    so.timeout = timeout;
    log(LogLevel::Info, name + ": data parallel rank " + std::to_string(rank) + " of " +
                            std::to_string(world) + ", rendezvous at " + at.host + ":" +
                            std::to_string(at.port) + (so.isServer ? " (hosting the store)" : ""));
    auto group = std::make_unique<Group>();
    try {
        auto tcp = c10::make_intrusive<c10d::TCPStore>(at.host, so);
        group->store = c10::make_intrusive<c10d::PrefixStore>("roundpipe/" + name, tcp);
        auto options = c10d::ProcessGroupGloo::Options::create(timeout);
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
        group->gloo =
            c10::make_intrusive<c10d::ProcessGroupGloo>(group->store, rank, world, options);
#ifdef RP_HAVE_C10D_NCCL
        if (!devices.empty() && devices[0].is_cuda())
            add_device_groups(*group, devices, rank, world, timeout);
#endif
    } catch (const std::exception &e) {
        fail(ErrorKind::Io, "data parallelism: rank " + std::to_string(rank) + " of " +
                                std::to_string(world) + " could not join the group at " +
                                at.host + ":" + std::to_string(at.port) + ": " + e.what());
    }
#ifdef RP_HAVE_C10D_NCCL
    const size_t device_groups = group->nccl.size();
#else
    const size_t device_groups = 0;
#endif
    log(LogLevel::Info, name + ": gradients are averaged " +
                            (device_groups ? "on the GPUs (NCCL)" : "in host memory (Gloo)"));
    auto dp = std::unique_ptr<DataParallel>(
        new DataParallel(std::move(group), rank, world, o.global_loss, o.timeout_ms));
    dp->device_groups_ = device_groups;
    return dp;
}

template <class F> void DataParallel::collective(const char *what, F &&run) {
    check_usable();
    try {
        c10::intrusive_ptr<c10d::Work> work = run(*group_->gloo);
        work->wait(std::chrono::milliseconds(timeout_ms_));
    } catch (const std::exception &e) {
        fail_collective(std::string(what) + " failed: " + e.what());
    }
}

void DataParallel::broadcast(const std::vector<at::Tensor> &tensors) {
    // One collective per tensor keeps the memory bounded; it runs once, before the first
    // training call.
    for (const at::Tensor &t : tensors) {
        std::vector<at::Tensor> one{t};
        collective("a broadcast of the initial weights",
                   [&](c10d::ProcessGroupGloo &g) { return g.broadcast(one); });
    }
}

void DataParallel::sum(at::Tensor &flat) {
    std::vector<at::Tensor> one{flat};
    collective("a gradient all-reduce", [&](c10d::ProcessGroupGloo &g) { return g.allreduce(one); });
}

double DataParallel::mean(double value) {
    std::vector<double> one{value};
    average(one);
    return one[0];
}

void DataParallel::average(std::vector<double> &values) {
    std::vector<at::Tensor> one{at::tensor(values, at::kDouble)};
    collective("an all-reduce of host values (losses, layer times)",
               [&](c10d::ProcessGroupGloo &g) { return g.allreduce(one); });
    const double *sums = one[0].data_ptr<double>();
    for (size_t i = 0; i < values.size(); ++i)
        values[i] = sums[i] / world_size_;
}

void DataParallel::check_same(uint64_t fingerprint, const std::string &what) {
    // The largest of (f, -f) over the ranks is (f, -f) itself only when every rank has f.
    const auto f = static_cast<int64_t>(fingerprint >> 1);
    std::vector<at::Tensor> one{at::tensor(std::vector<int64_t>{f, -f}, at::kLong)};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    collective("a plan check", [&](c10d::ProcessGroupGloo &g) { return g.allreduce(one, max); });
    require(one[0][0].item<int64_t>() == f && one[0][1].item<int64_t>() == -f,
            "data parallelism: rank " + std::to_string(rank_) + ": the ranks differ in " + what +
                "; with GPU data parallelism every rank must run the same stage plan on the "
                "same number of GPUs (their gradients meet in per-GPU collectives)");
}

#ifdef RP_HAVE_C10D_NCCL
std::shared_ptr<void> DataParallel::average_on_device(const at::Tensor &flat,
                                                      const at::Tensor &sums) {
    check_usable();
    const size_t d = static_cast<size_t>(flat.device().index());
    auto &g = *group_;
    require(d < g.nccl.size(), "data parallelism: no NCCL group for GPU " + std::to_string(d));
    std::vector<at::Tensor> a{flat}, b{sums};
    c10d::AllreduceOptions avg;
    avg.reduceOp = c10d::ReduceOp::AVG;
    c10::intrusive_ptr<c10d::Work> w1, w2;
    auto ready = std::make_shared<at::cuda::CUDAEvent>(cudaEventDisableTiming);
    try {
        // ProcessGroupNCCL runs on its own stream, after the current stream's work so far.
        w1 = g.nccl[d]->allreduce(a, avg);
        w2 = g.nccl[d]->allreduce(b);
        // wait() makes the current stream wait for NCCL: let a side stream do it, so that the
        // compute stream goes on with the layers below while the collective runs.
        c10::cuda::CUDAStreamGuard guard(g.after_nccl[d]);
        w1->wait();
        w2->wait();
        ready->record(g.after_nccl[d]);
    } catch (const std::exception &e) {
        fail_collective(all_reduce_failed(e.what()));
    }
    const auto now = CollectiveWatch::Clock::now();
    for (const auto &w : {w1, w2})
        g.in_flight.add(w, now);
    return ready;
}

void DataParallel::watch_device_collectives() {
    const std::string broken = why_broken();
    if (!broken.empty())
        fail(ErrorKind::Io, "data parallelism: rank " + std::to_string(rank_) + ": " + broken);
    const std::string failure = group_->in_flight.scan(CollectiveWatch::Clock::now(),
                                                       std::chrono::milliseconds(timeout_ms_));
    if (failure.empty())
        return;
    abort_device_groups();
    fail_collective(failure);
}

void DataParallel::abort_device_groups() {
    // On threads of their own: an abort that blocked would turn the hang this ends into another.
    std::call_once(group_->aborted, [&] {
        for (auto &pg : group_->nccl)
            std::thread([pg] {
                name_this_thread("rp-nccl-abort");
                try {
                    pg->abort();
                } catch (...) {
                }
            }).detach();
    });
}

void DataParallel::finish_device_collectives(bool report_failure) {
    const std::vector<c10::intrusive_ptr<c10d::Work>> works = group_->in_flight.take_all();
    if (!report_failure)
        return;
    for (auto &w : works)
        if (std::exception_ptr e = w->exception()) {
            try {
                std::rethrow_exception(e);
            } catch (const std::exception &err) {
                fail_collective(all_reduce_failed(err.what()));
            }
        }
}
#else
std::shared_ptr<void> DataParallel::average_on_device(const at::Tensor &, const at::Tensor &) {
    fail(ErrorKind::Internal, "data parallelism: this build has no NCCL");
}
void DataParallel::finish_device_collectives(bool) {}
void DataParallel::watch_device_collectives() {}
void DataParallel::abort_device_groups() {}
#endif

#else // built without libtorch's Gloo headers

bool data_parallel_available() { return false; }

struct DataParallel::Group {};

std::unique_ptr<DataParallel> DataParallel::join(const DataParallelOptions &, const std::string &,
                                                 const std::vector<at::Device> &) {
    fail(ErrorKind::InvalidArgument,
         "data parallelism: this libroundpipe was built without c10d's Gloo support (the "
         "gloo headers were not found at configure time; on Debian: apt install libgloo-dev)");
}
void DataParallel::broadcast(const std::vector<at::Tensor> &) {}
void DataParallel::sum(at::Tensor &) {}
void DataParallel::average(std::vector<double> &) {}
double DataParallel::mean(double value) { return value; }
void DataParallel::check_same(uint64_t, const std::string &) {}
std::shared_ptr<void> DataParallel::average_on_device(const at::Tensor &, const at::Tensor &) {
    return nullptr;
}
void DataParallel::finish_device_collectives(bool) {}
void DataParallel::watch_device_collectives() {}
void DataParallel::abort_device_groups() {}

#endif

DataParallel::DataParallel(std::unique_ptr<Group> group, int rank, int world_size,
                           bool global_loss, int64_t timeout_ms)
    : group_(std::move(group)), rank_(rank), world_size_(world_size), global_loss_(global_loss),
      timeout_ms_(timeout_ms) {}

DataParallel::~DataParallel() {
#ifdef RP_HAVE_C10D_NCCL
    if (!why_broken().empty())
        return; // aborted (or being aborted): a shutdown would wait for the dead rank
    for (auto &pg : group_->nccl)
        try {
            pg->shutdown(); // what torch.distributed.destroy_process_group does
        } catch (...) {
        }
#endif
}

void DataParallel::fail_collective(const std::string &what_failed) {
    mark_broken(what_failed);
    fail(ErrorKind::Io, "data parallelism: rank " + std::to_string(rank_) + ": " + what_failed +
                            " (another rank died, failed its call or did not arrive within " +
                            std::to_string(timeout_ms_) + " ms)");
}

void DataParallel::mark_broken(const std::string &why) {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    if (broken_.empty())
        broken_ = why;
}

std::string DataParallel::why_broken() const {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    return broken_;
}

void DataParallel::check_usable() const {
    const std::string broken = why_broken();
    if (!broken.empty())
        fail(ErrorKind::State, "data parallelism: rank " + std::to_string(rank_) +
                                   ": the group is unusable since " + broken +
                                   "; the ranks' collectives no longer match, so destroy this "
                                   "model and create it again on every rank");
}

} // namespace rp
