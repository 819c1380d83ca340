// Memory figures of this process and machine: host resident set and available memory from
// /proc, and GPU allocator peaks through the C API.
#pragma once

#include <cstdint>

namespace tb {

// MemAvailable of /proc/meminfo in bytes; -1 if absent.
int64_t mem_available_bytes();

// Restart the kernel's peak-RSS mark (Linux >= 4.0), so the RoundPipe phase reports its own
// peak and not the baseline's. Best effort; false when it could not.
bool reset_peak_rss();

// Peak resident set: VmHWM of /proc/self/status, else getrusage's ru_maxrss.
int64_t peak_rss_bytes();

// Largest rp_cuda_memory_stats peak over GPUs 0..num_gpus-1 (-1 when none answers), and the
// restart of those peaks.
int64_t gpu_peak(int num_gpus);
void gpu_reset_peak(int num_gpus);

} // namespace tb
