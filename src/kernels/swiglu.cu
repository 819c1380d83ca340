// SwiGLU, forward and backward, as grid-stride elementwise kernels: 16-byte vectors over the
// body, the last n % vector elements one per thread, or scalars throughout when a pointer is
// not 16-byte aligned (a gate/up pair cut from one fused projection at an odd column).
#include "kernels/cuda_common.cuh"
#include "kernels/swiglu_cuda.h"

namespace rp::kernels {
namespace {

using namespace cuda;

constexpr int kThreads = 256;

// ATen's silu, x / (1 + exp(-x)), so fp32 results match at::silu's.
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const T *__restrict__ gate, const T *__restrict__ up, T *__restrict__ y,
                          int64_t n) {
    const int64_t nvec = n / N, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t v = first; v < nvec; v += stride) {
        const Vec<T, N> g = load<T, N>(gate + v * N), u = load<T, N>(up + v * N);
        Vec<T, N> out;
#pragma unroll
        for (int k = 0; k < N; ++k)
            out.v[k] = from_float<T>(silu(to_float(g.v[k])) * to_float(u.v[k]));
        store<T, N>(y + v * N, out);
    }
    const int64_t i = nvec * N + first; // the tail: fewer than N elements
    if (i < n)
        y[i] = from_float<T>(silu(to_float(gate[i])) * to_float(up[i]));
}

// The gradients of one element; autograd's silu_backward formula, in fp32.
__device__ __forceinline__ void swiglu_grad(float dy, float g, float u, float &dg, float &du) {
    const float s = 1.0f / (1.0f + expf(-g));
    dg = (dy * u) * (s * (1.0f + g * (1.0f - s)));
    du = dy * silu(g);
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T *__restrict__ dy, const T *__restrict__ gate,
                           const T *__restrict__ up, T *__restrict__ dgate, T *__restrict__ dup,
                           int64_t n) {
    const int64_t nvec = n / N, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t v = first; v < nvec; v += stride) {
        const Vec<T, N> d = load<T, N>(dy + v * N), g = load<T, N>(gate + v * N),
                        u = load<T, N>(up + v * N);
        Vec<T, N> dg, du;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float a, b;
            swiglu_grad(to_float(d.v[k]), to_float(g.v[k]), to_float(u.v[k]), a, b);
            dg.v[k] = from_float<T>(a);
            du.v[k] = from_float<T>(b);
        }
        store<T, N>(dgate + v * N, dg);
        store<T, N>(dup + v * N, du);
    }
    const int64_t i = nvec * N + first;
    if (i < n) {
        float a, b;
        swiglu_grad(to_float(dy[i]), to_float(gate[i]), to_float(up[i]), a, b);
        dgate[i] = from_float<T>(a);
        dup[i] = from_float<T>(b);
    }
}

bool all_aligned(std::initializer_list<const void *> ptrs) {
    for (const void *p : ptrs)
        if (!aligned16(p))
            return false;
    return true;
}

} // namespace

cudaError_t swiglu_forward_cuda(ElemType type, const void *gate, const void *up, void *y, int64_t n,
                                int max_blocks, cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    return with_elem_type(type, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        constexpr int vec = 16 / sizeof(T);
        const T *g = static_cast<const T *>(gate), *u = static_cast<const T *>(up);
        T *out = static_cast<T *>(y);
        if (all_aligned({gate, up, y}))
            swiglu_forward_kernel<T, vec>
                <<<grid_for(n / vec + 1, kThreads, max_blocks), kThreads, 0, stream>>>(g, u, out,
                                                                                       n);
        else
            swiglu_forward_kernel<T, 1>
                <<<grid_for(n, kThreads, max_blocks), kThreads, 0, stream>>>(g, u, out, n);
        return cudaGetLastError();
    });
}

cudaError_t swiglu_backward_cuda(ElemType type, const void *dy, const void *gate, const void *up,
                                 void *dgate, void *dup, int64_t n, int max_blocks,
                                 cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    return with_elem_type(type, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        constexpr int vec = 16 / sizeof(T);
        const T *d = static_cast<const T *>(dy), *g = static_cast<const T *>(gate),
                *u = static_cast<const T *>(up);
        T *dg = static_cast<T *>(dgate), *du = static_cast<T *>(dup);
        if (all_aligned({dy, gate, up, dgate, dup}))
            swiglu_backward_kernel<T, vec>
                <<<grid_for(n / vec + 1, kThreads, max_blocks), kThreads, 0, stream>>>(d, g, u, dg,
                                                                                       du, n);
        else
            swiglu_backward_kernel<T, 1>
                <<<grid_for(n, kThreads, max_blocks), kThreads, 0, stream>>>(d, g, u, dg, du, n);
        return cudaGetLastError();
    });
}

} // namespace rp::kernels
