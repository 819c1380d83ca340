#include "engine/data_parallel.h"

#include <chrono>
#include <cstdlib>

#include "base/error.h"
#include "base/log.h"

#ifdef RP_HAVE_C10D_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
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
};

std::unique_ptr<DataParallel> DataParallel::join(const DataParallelOptions &o,
                                                 const std::string &name) {
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
    } catch (const std::exception &e) {
        fail(ErrorKind::Io, "data parallelism: rank " + std::to_string(rank) + " of " +
                                std::to_string(world) + " could not join the group at " +
                                at.host + ":" + std::to_string(at.port) + ": " + e.what());
    }
    return std::unique_ptr<DataParallel>(
        new DataParallel(std::move(group), rank, world, o.global_loss, o.timeout_ms));
}

template <class F> void DataParallel::collective(const char *what, F &&run) {
    check_usable();
    try {
        c10::intrusive_ptr<c10d::Work> work = run(*group_->gloo);
        work->wait(std::chrono::milliseconds(timeout_ms_));
    } catch (const std::exception &e) {
        broken_ = std::string(what) + " failed: " + e.what();
        fail(ErrorKind::Io, "data parallelism: rank " + std::to_string(rank_) + ": " + broken_ +
                                " (another rank died, failed its call or did not arrive within " +
                                std::to_string(timeout_ms_) + " ms)");
    }
}

void DataParallel::broadcast(const std::vector<at::Tensor> &tensors) {
    // One collective per tensor keeps the memory bounded; it runs once, at creation.
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
    std::vector<at::Tensor> one{at::full({1}, value, at::kDouble)};
    collective("a loss all-reduce", [&](c10d::ProcessGroupGloo &g) { return g.allreduce(one); });
    return one[0].item<double>() / world_size_;
}

#else // built without libtorch's Gloo headers

bool data_parallel_available() { return false; }

struct DataParallel::Group {};

std::unique_ptr<DataParallel> DataParallel::join(const DataParallelOptions &, const std::string &) {
    fail(ErrorKind::InvalidArgument,
         "data parallelism: this libroundpipe was built without c10d's Gloo support (the "
         "gloo headers were not found at configure time; on Debian: apt install libgloo-dev)");
}
void DataParallel::broadcast(const std::vector<at::Tensor> &) {}
void DataParallel::sum(at::Tensor &) {}
double DataParallel::mean(double value) { return value; }

#endif

DataParallel::DataParallel(std::unique_ptr<Group> group, int rank, int world_size,
                           bool global_loss, int64_t timeout_ms)
    : group_(std::move(group)), rank_(rank), world_size_(world_size), global_loss_(global_loss),
      timeout_ms_(timeout_ms) {}

DataParallel::~DataParallel() = default;

void DataParallel::check_usable() const {
    if (!broken_.empty())
        fail(ErrorKind::State, "data parallelism: rank " + std::to_string(rank_) +
                                   ": the group is unusable since " + broken_ +
                                   "; the ranks' collectives no longer match, so destroy this "
                                   "model and create it again on every rank");
}

} // namespace rp
