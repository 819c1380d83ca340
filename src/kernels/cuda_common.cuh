// Device helpers shared by the .cu files: fp32 <-> element conversions, 16-byte vectors and
// warp/block sums. CUDA headers only (see CMakeLists.txt: nvcc never compiles ATen).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/elem_type.h"

namespace rp::kernels::cuda {

// All arithmetic is in fp32; values are rounded (to nearest even, as c10::BFloat16 and
// c10::Half do) only where a kernel stores or where it reproduces a rounding of Hugging Face's
// expression.
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
    return __float2half_rn(v);
}

// The value v takes once stored as a T (the rounding points of Hugging Face's expressions).
template <typename T> __device__ __forceinline__ float round_to(float v) {
    return to_float<T>(from_float<T>(v));
}

// N consecutive elements moved as one load/store (N * sizeof(T) = 16 bytes on the fast path).
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

template <typename T, int N> __device__ __forceinline__ Vec<T, N> load(const T *p) {
    return *reinterpret_cast<const Vec<T, N> *>(p);
}
template <typename T, int N> __device__ __forceinline__ void store(T *p, const Vec<T, N> &v) {
    *reinterpret_cast<Vec<T, N> *>(p) = v;
}

// Sum over aligned groups of `width` lanes (a power of two <= 32); every lane of the warp must
// call it, and every lane of a group gets the group's sum.
__device__ __forceinline__ float group_sum(float v, int width) {
    for (int o = width / 2; o > 0; o /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets it. `scratch` holds 32
// floats. The leading barrier lets a loop call it again while slower warps still read the
// previous result.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    v = group_sum(v, 32);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0)
        scratch[warp] = v;
    __syncthreads();
    v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0f;
    return group_sum(v, 32);
}

// Calls f(T{}) with the element type named by `t` (a generic lambda picks its kernel from it).
template <typename F> cudaError_t with_elem_type(ElemType t, F &&f) {
    switch (t) {
    case ElemType::F32:
        return f(float{});
    case ElemType::BF16:
        return f(__nv_bfloat16{});
    case ElemType::F16:
        return f(__half{});
    }
    return cudaErrorInvalidValue;
}

inline bool aligned16(const void *p) {
    return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Blocks of `threads` for a grid-stride loop over `work` items: one item per thread where that
// fits under `max_blocks`, else `max_blocks` (each thread then takes several); at least one.
inline int grid_for(int64_t work, int threads, int max_blocks) {
    const int64_t blocks = (work + threads - 1) / threads;
    return static_cast<int>(blocks < 1 ? 1 : (blocks < max_blocks ? blocks : max_blocks));
}

} // namespace rp::kernels::cuda
