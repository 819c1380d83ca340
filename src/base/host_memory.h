// What the host can still give this process, read before large allocations so that a model too
// large for the host is refused with figures instead of being found out by the kernel's OOM
// killer (or a container's). The smallest of:
//   - MemAvailable of /proc/meminfo: the kernel's estimate of memory allocatable without swapping;
//   - the headroom of the process's memory cgroup (limit minus usage, cgroup v2 or v1): inside a
//     container, MemAvailable describes the whole machine, not what the container may still use;
//   - RP_HOST_MEMORY_LIMIT_MB from the environment, for a caller that shares the host and wants
//     RoundPipe to assume less (the fuzz harness uses it to stay inside its memory budget).
#pragma once
#include <cstdint>
#include <string>

namespace rp {

struct HostMemoryHeadroom {
    int64_t bytes = -1; // -1 when nothing says (no /proc, no cgroup limit, no variable)
    std::string source; // which bound it is: "MemAvailable", "cgroup memory limit", ...
};

HostMemoryHeadroom available_host_memory();

} // namespace rp
