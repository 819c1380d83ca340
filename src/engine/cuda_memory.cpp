#include "engine/cuda_memory.h"

#include <algorithm>

#ifdef RP_HAVE_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <cuda_runtime_api.h>

namespace rp {
namespace {

// The caching allocator learns the device count when CUDA is initialised, which libtorch does
// lazily (at the first CUDA tensor or pinned allocation); before that every per-device call
// fails with "Invalid device argument". A model whose weights are not page-locked by the
// allocator (pin modes register and off) reaches these functions first.
void initialise_cuda() { at::globalContext().lazyInitDevice(c10::DeviceType::CUDA); }

} // namespace

GpuMemoryStats gpu_memory_stats(int device) {
    using namespace c10::cuda::CUDACachingAllocator;
    initialise_cuda();
    GpuMemoryStats s;
    auto stats = getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    s.allocated_bytes = stats.allocated_bytes[all].current;
    s.peak_allocated_bytes = stats.allocated_bytes[all].peak;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
        s.free_bytes = static_cast<int64_t>(free_b);
        s.total_bytes = static_cast<int64_t>(total_b);
    }
    return s;
}

void reset_gpu_peak_memory(int device) {
    initialise_cuda();
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

void release_cached_gpu_memory() {
    initialise_cuda();
    c10::cuda::CUDACachingAllocator::emptyCache();
}

void limit_gpu_memory(int device, int64_t bytes) {
    GpuMemoryStats s = gpu_memory_stats(device);
    if (s.total_bytes <= 0)
        return;
    double fraction = std::min(1.0, static_cast<double>(bytes) / static_cast<double>(s.total_bytes));
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction,
                                                       static_cast<c10::DeviceIndex>(device));
}

bool register_host_memory(void *ptr, int64_t bytes) {
    return bytes == 0 ||
           cudaHostRegister(ptr, static_cast<size_t>(bytes), cudaHostRegisterDefault) ==
               cudaSuccess;
}

void unregister_host_memory(void *ptr) { cudaHostUnregister(ptr); }

void *current_cuda_stream(int device) {
    return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

bool gpus_copy_peer_to_peer(const std::vector<int> &devices) {
    if (devices.size() < 2)
        return false;
    initialise_cuda();
    for (int a : devices)
        for (int b : devices)
            if (a != b && !at::cuda::get_p2p_access(static_cast<c10::DeviceIndex>(a),
                                                    static_cast<c10::DeviceIndex>(b)))
                return false;
    return true;
}

} // namespace rp

#else

namespace rp {
GpuMemoryStats gpu_memory_stats(int) { return {}; }
void reset_gpu_peak_memory(int) {}
void release_cached_gpu_memory() {}
void limit_gpu_memory(int, int64_t) {}
bool register_host_memory(void *, int64_t) { return false; }
void unregister_host_memory(void *) {}
void *current_cuda_stream(int) { return nullptr; }
bool gpus_copy_peer_to_peer(const std::vector<int> &) { return false; }
} // namespace rp
#endif
