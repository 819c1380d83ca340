// The non-finite check as a grid-stride loop that only reads: 16-byte vectors over the body, the
// last n % vector elements one per thread, or scalars throughout when the data is not 16-byte
// aligned. Each block reduces its threads' findings and one thread per block writes the flag,
// so the only writes are of the same value (+inf) to one address.
#include "kernels/cuda_common.cuh"
#include "kernels/nonfinite_cuda.h"

namespace rp::kernels {
namespace {

using namespace cuda;

constexpr int kThreads = 256;

// False for inf and nan (a nan fails every comparison); every element type widens to fp32
// exactly, so this is the element's own finiteness.
__device__ __forceinline__ bool finite(float x) { return fabsf(x) <= 3.402823466e38f; }

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    nonfinite_flag_kernel(const T *__restrict__ data, int64_t n, double *__restrict__ flag) {
    __shared__ float scratch[32];
    const int64_t nvec = n / N, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    bool bad = false;
    for (int64_t v = first; v < nvec; v += stride) {
        const Vec<T, N> x = load<T, N>(data + v * N);
#pragma unroll
        for (int k = 0; k < N; ++k)
            bad |= !finite(to_float(x.v[k]));
    }
    const int64_t i = nvec * N + first; // the tail: fewer than N elements
    if (i < n)
        bad |= !finite(to_float(data[i]));
    const float found = block_sum(bad ? 1.0f : 0.0f, scratch);
    if (threadIdx.x == 0 && found > 0.0f)
        *flag = static_cast<double>(INFINITY);
}

} // namespace

cudaError_t nonfinite_flag_cuda(ElemType type, const void *data, int64_t n, double *flag,
                                int max_blocks, cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    return with_elem_type(type, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        constexpr int vec = 16 / sizeof(T);
        const T *x = static_cast<const T *>(data);
        if (aligned16(data))
            nonfinite_flag_kernel<T, vec>
                <<<grid_for(n / vec + 1, kThreads, max_blocks), kThreads, 0, stream>>>(x, n, flag);
        else
            nonfinite_flag_kernel<T, 1>
                <<<grid_for(n, kThreads, max_blocks), kThreads, 0, stream>>>(x, n, flag);
        return cudaGetLastError();
    });
}

} // namespace rp::kernels
