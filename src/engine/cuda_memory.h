// GPU memory facts and housekeeping, behind one small interface so that only this file and
// cuda_lane.cpp include CUDA headers. Every function is a harmless no-op (or zero) without CUDA.
#pragma once
#include <cstdint>
#include <vector>

namespace rp {

struct GpuMemoryStats {
    int64_t allocated_bytes = 0;      // held by tensors now (caching allocator)
    int64_t peak_allocated_bytes = 0; // since the last reset
    int64_t free_bytes = 0;           // free on the device (driver)
    int64_t total_bytes = 0;
};

GpuMemoryStats gpu_memory_stats(int device);
void reset_gpu_peak_memory(int device);
// Makes libtorch's caching allocator refuse to hold more than `bytes` on `device`: allocations
// beyond it fail with an out-of-memory error instead of growing. Per process and device.
void limit_gpu_memory(int device, int64_t bytes);
// Returns cached blocks to the driver, e.g. after an out-of-memory failure.
void release_cached_gpu_memory();
// The stream current on this thread for `device` (a cudaStream_t): where caller-defined code
// must launch its work. Null without CUDA.
void *current_cuda_stream(int device);

// Whether every GPU of `devices` (indices) can copy from every other directly (peer to peer, over
// NVLink or PCIe), with that access enabled; false for fewer than two or without CUDA.
bool gpus_copy_peer_to_peer(const std::vector<int> &devices);

// Page-locks existing host memory (pin mode "register"); false when CUDA refuses.
bool register_host_memory(void *ptr, int64_t bytes);
void unregister_host_memory(void *ptr);

} // namespace rp
