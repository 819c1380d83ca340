// What the host can still give: MemAvailable of /proc/meminfo, the kernel's estimate of memory a
// process can allocate without swapping. Read before large allocations, so a model too large for
// the host is refused with figures instead of being found out by the kernel's OOM killer.
#pragma once
#include <cstdint>

namespace rp {

// Bytes available, or -1 when the kernel does not say (no /proc).
int64_t available_host_memory_bytes();

} // namespace rp
