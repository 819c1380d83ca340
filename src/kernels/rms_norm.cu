// RMSNorm and residual-add + RMSNorm, forward and backward: one block per row, 16-byte vector
// accesses when the row length and every pointer allow it, the row held in registers between
// the reduction and the output so it is read once.
#include "kernels/cuda_common.cuh"
#include "kernels/rms_norm_cuda.h"

namespace rp::kernels {
namespace {

using namespace cuda;

// Threads per row and vectors per thread: the smallest per-thread register load that keeps the
// block at most 512 threads (1024 for the longest rows, whose kernels are therefore limited to
// 64 registers a thread: see the __launch_bounds__).
struct RowPlan {
    int vpt = 0;
    int threads = 0;
};

bool plan_row(int64_t nvec, RowPlan &plan) {
    for (int vpt : {1, 2, 4, 8}) {
        const int64_t threads = ((nvec + vpt - 1) / vpt + 31) / 32 * 32;
        if (threads <= 512 || (vpt == 8 && threads <= 1024)) {
            plan = {vpt, static_cast<int>(threads)};
            return true;
        }
    }
    return false;
}

template <typename T, int N, int VPT, bool ADD>
__global__ void __launch_bounds__(VPT == 8 ? 1024 : 512)
    rms_norm_forward_kernel(const T *__restrict__ x, const T *__restrict__ residual,
                            const T *__restrict__ weight, T *__restrict__ sum, T *__restrict__ y,
                            float *__restrict__ rstd_out, int64_t rows, int dim, float eps) {
    __shared__ float scratch[32];
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64_t base = row * dim;
        float v[VPT][N];
        float squares = 0.0f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = (threadIdx.x + j * blockDim.x) * N;
            if (i >= dim)
                continue;
            Vec<T, N> a = load<T, N>(x + base + i);
            if constexpr (ADD) {
                // Hugging Face adds in the model dtype and normalises the rounded sum.
                const Vec<T, N> b = load<T, N>(residual + base + i);
#pragma unroll
                for (int k = 0; k < N; ++k)
                    a.v[k] = from_float<T>(to_float(a.v[k]) + to_float(b.v[k]));
                store<T, N>(sum + base + i, a);
            }
#pragma unroll
            for (int k = 0; k < N; ++k) {
                v[j][k] = to_float(a.v[k]);
                squares += v[j][k] * v[j][k];
            }
        }
        const float rstd = rsqrtf(block_sum(squares, scratch) / static_cast<float>(dim) + eps);
        if (threadIdx.x == 0)
            rstd_out[row] = rstd;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = (threadIdx.x + j * blockDim.x) * N;
            if (i >= dim)
                continue;
            const Vec<T, N> w = load<T, N>(weight + i);
            Vec<T, N> out;
            // Hugging Face's rounding points: the normalised row is rounded to the model dtype,
            // then multiplied by the weight (one more rounding).
#pragma unroll
            for (int k = 0; k < N; ++k)
                out.v[k] = from_float<T>(to_float(w.v[k]) * round_to<T>(v[j][k] * rstd));
            store<T, N>(y + base + i, out);
        }
    }
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(VPT == 8 ? 1024 : 512)
    rms_norm_backward_kernel(const T *__restrict__ dy, const T *__restrict__ dsum,
                             const T *__restrict__ x, const T *__restrict__ weight,
                             const float *__restrict__ rstd_in, T *__restrict__ dx,
                             float *__restrict__ dweight_partial, int64_t rows, int dim) {
    __shared__ float scratch[32];
    // This block's share of dweight stays in registers across all its rows: each thread always
    // owns the same columns, so the partials are written once, at the end.
    float dw[VPT][N];
#pragma unroll
    for (int j = 0; j < VPT; ++j)
#pragma unroll
        for (int k = 0; k < N; ++k)
            dw[j][k] = 0.0f;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64_t base = row * dim;
        const float rstd = rstd_in[row];
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = (threadIdx.x + j * blockDim.x) * N;
            if (i >= dim)
                continue;
            const Vec<T, N> xv = load<T, N>(x + base + i), g = load<T, N>(dy + base + i),
                            w = load<T, N>(weight + i);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const float n = to_float(xv.v[k]) * rstd, gk = to_float(g.v[k]);
                dot += gk * to_float(w.v[k]) * n;
                dw[j][k] += gk * round_to<T>(n); // the weight multiplied the rounded row
            }
        }
        dot = block_sum(dot, scratch) / static_cast<float>(dim);
        // Second pass over the row: the reloads hit L1/L2 (a row is at most a few tens of KiB),
        // and keeping x, dy and the weight in registers too would cap the row length.
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = (threadIdx.x + j * blockDim.x) * N;
            if (i >= dim)
                continue;
            const Vec<T, N> xv = load<T, N>(x + base + i), g = load<T, N>(dy + base + i),
                            w = load<T, N>(weight + i);
            Vec<T, N> s;
            if (dsum != nullptr)
                s = load<T, N>(dsum + base + i);
            Vec<T, N> out;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                // dn = dy * weight in fp32: Hugging Face's autograd rounds it to the model dtype
                // first (one rounding fewer here in bf16/fp16).
                const float n = to_float(xv.v[k]) * rstd;
                const float dn = to_float(g.v[k]) * to_float(w.v[k]);
                float d = rstd * (dn - n * dot);
                if (dsum != nullptr)
                    d += to_float(s.v[k]); // autograd would round before this sum: one fewer
                out.v[k] = from_float<T>(d);
            }
            store<T, N>(dx + base + i, out);
        }
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int i = (threadIdx.x + j * blockDim.x) * N;
        if (i >= dim)
            continue;
#pragma unroll
        for (int k = 0; k < N; ++k)
            dweight_partial[static_cast<int64_t>(blockIdx.x) * dim + i + k] = dw[j][k];
    }
}

template <typename T, int N, bool ADD>
void launch_forward(const RowPlan &plan, int grid, cudaStream_t stream, const T *x,
                    const T *residual, const T *weight, T *sum, T *y, float *rstd, int64_t rows,
                    int dim, float eps) {
    switch (plan.vpt) {
#define RP_CASE(V)                                                                                 \
    case V:                                                                                        \
        rms_norm_forward_kernel<T, N, V, ADD><<<grid, plan.threads, 0, stream>>>(                  \
            x, residual, weight, sum, y, rstd, rows, dim, eps);                                    \
        break;
        RP_CASE(1)
        RP_CASE(2)
        RP_CASE(4)
        RP_CASE(8)
#undef RP_CASE
    }
}

template <typename T, int N>
void launch_backward(const RowPlan &plan, int grid, cudaStream_t stream, const T *dy,
                     const T *dsum, const T *x, const T *weight, const float *rstd, T *dx,
                     float *partial, int64_t rows, int dim) {
    switch (plan.vpt) {
#define RP_CASE(V)                                                                                 \
    case V:                                                                                        \
        rms_norm_backward_kernel<T, N, V><<<grid, plan.threads, 0, stream>>>(                      \
            dy, dsum, x, weight, rstd, dx, partial, rows, dim);                                    \
        break;
        RP_CASE(1)
        RP_CASE(2)
        RP_CASE(4)
        RP_CASE(8)
#undef RP_CASE
    }
}

// Elements per 16-byte vector, or 1 when the row length or a pointer does not allow vectors.
template <typename T> int vector_width(int64_t dim, std::initializer_list<const void *> ptrs) {
    constexpr int n = 16 / sizeof(T);
    if (dim % n != 0)
        return 1;
    for (const void *p : ptrs)
        if (!aligned16(p))
            return 1;
    return n;
}

} // namespace

cudaError_t rms_norm_forward_cuda(ElemType type, const void *x, const void *residual,
                                  const void *weight, void *sum, void *y, float *rstd,
                                  int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
    return with_elem_type(type, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        constexpr int vec = 16 / sizeof(T);
        const int n = vector_width<T>(dim, {x, residual, weight, sum, y});
        RowPlan plan;
        if (!plan_row(dim / n, plan))
            return cudaErrorNotSupported;
        if (rows == 0)
            return cudaSuccess;
        const int grid = static_cast<int>(rows < (1 << 30) ? rows : (1 << 30));
        const T *xt = static_cast<const T *>(x), *rt = static_cast<const T *>(residual),
                *wt = static_cast<const T *>(weight);
        T *st = static_cast<T *>(sum), *yt = static_cast<T *>(y);
        const int d = static_cast<int>(dim);
        if (residual != nullptr) {
            if (n == vec)
                launch_forward<T, vec, true>(plan, grid, stream, xt, rt, wt, st, yt, rstd, rows,
                                             d, eps);
            else
                launch_forward<T, 1, true>(plan, grid, stream, xt, rt, wt, st, yt, rstd, rows, d,
                                           eps);
        } else if (n == vec) {
            launch_forward<T, vec, false>(plan, grid, stream, xt, rt, wt, st, yt, rstd, rows, d,
                                          eps);
        } else {
            launch_forward<T, 1, false>(plan, grid, stream, xt, rt, wt, st, yt, rstd, rows, d,
                                        eps);
        }
        return cudaGetLastError();
    });
}

cudaError_t rms_norm_backward_cuda(ElemType type, const void *dy, const void *dsum,
                                   const void *x, const void *weight, const float *rstd,
                                   void *dx, float *dweight_partial, int blocks, int64_t rows,
                                   int64_t dim, cudaStream_t stream) {
    return with_elem_type(type, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        constexpr int vec = 16 / sizeof(T);
        const int n = vector_width<T>(dim, {dy, dsum, x, weight, dx});
        RowPlan plan;
        if (!plan_row(dim / n, plan))
            return cudaErrorNotSupported;
        if (blocks <= 0)
            return cudaErrorInvalidValue;
        const T *g = static_cast<const T *>(dy), *s = static_cast<const T *>(dsum),
                *xt = static_cast<const T *>(x), *wt = static_cast<const T *>(weight);
        T *out = static_cast<T *>(dx);
        const int d = static_cast<int>(dim);
        // Every block writes its row of partials, even one that got no row (zeros).
        if (n == vec)
            launch_backward<T, vec>(plan, blocks, stream, g, s, xt, wt, rstd, out,
                                    dweight_partial, rows, d);
        else
            launch_backward<T, 1>(plan, blocks, stream, g, s, xt, wt, rstd, out, dweight_partial,
                                  rows, d);
        return cudaGetLastError();
    });
}

} // namespace rp::kernels
