// Rotary embedding with the optional per-head RMSNorm in front, forward and backward. A row is
// one head of one token (head_dim elements, 128 in Qwen3 and Llama); a group of G lanes of a
// warp owns a row, each lane moving 16-byte vectors of both halves (element i of the first half
// pairs with element i of the second), so 128-element bf16 rows take 8 lanes and a warp does 4
// rows. The norm and the rotation share one read of the row.
#include "kernels/cuda_common.cuh"
#include "kernels/rope_cuda.h"

namespace rp::kernels {
namespace {

using namespace cuda;

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 1024; // the backward's per-block dweight tile lives in shared memory

// Lanes per row G (a power of two <= 32) and vectors per lane and half (at most 4, so a lane's
// share of dweight fits in registers).
struct HeadPlan {
    int n = 1;     // elements per vector
    int group = 1; // lanes per row
    int iters = 1; // vectors per lane in each half
};

template <typename T>
bool plan_head(int64_t head_dim, std::initializer_list<const void *> ptrs, HeadPlan &plan) {
    if (head_dim <= 0 || head_dim % 2 != 0 || head_dim > kMaxHeadDim)
        return false;
    const int64_t half = head_dim / 2;
    plan.n = 16 / sizeof(T);
    // A half that is a whole number of vectors keeps the second half's and the tables' rows
    // aligned too (their offsets are multiples of half).
    if (half % plan.n != 0)
        plan.n = 1;
    for (const void *p : ptrs)
        if (!aligned16(p))
            plan.n = 1;
    const int64_t nvec = half / plan.n;
    plan.group = 1;
    while (plan.group < 32 && plan.group < nvec)
        plan.group *= 2;
    plan.iters = static_cast<int>((nvec + plan.group - 1) / plan.group);
    return plan.iters <= 4;
}

// Row-to-table index: rows are [batch, seq, heads] flattened; the tables are [cos_batch, seq].
__device__ __forceinline__ int64_t table_row(int64_t row, int64_t heads, int64_t seq,
                                             int64_t cos_batch) {
    const int64_t token = row / heads;
    const int64_t t = token % seq;
    return cos_batch == 1 ? t : token; // token = b * seq + t
}

// Warps walk the rows in lockstep: every lane of a warp runs the same number of loop trips, so
// the group sums (warp shuffles over all 32 lanes) always see the whole warp.
struct RowWalk {
    int lane;        // lane within the row's group
    int64_t first;   // this group's first row
    int64_t step;    // rows between a group's successive rows
    int64_t warp0;   // the warp's first row
    int64_t rows_per_warp;
    __device__ RowWalk(int group) {
        const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
        lane = threadIdx.x % group;
        rows_per_warp = 32 / group;
        warp0 = thread / 32 * rows_per_warp;
        first = warp0 + (threadIdx.x % 32) / group;
        step = static_cast<int64_t>(gridDim.x) * blockDim.x / 32 * rows_per_warp;
    }
};

template <typename T, int N, bool NORM>
__global__ void __launch_bounds__(kThreads)
    rope_forward_kernel(const T *__restrict__ x, const T *__restrict__ weight,
                        const T *__restrict__ cos, const T *__restrict__ sin, T *__restrict__ y,
                        float *__restrict__ rstd_out, int64_t rows, int64_t heads, int64_t seq,
                        int64_t cos_batch, int half, int group, float eps) {
    const RowWalk walk(group);
    const int stride = group * N;
    for (int64_t w0 = walk.warp0, row = walk.first; w0 < rows; w0 += walk.step, row += walk.step) {
        const bool active = row < rows;
        const T *xr = x + row * 2 * half;
        float rstd = 1.0f;
        if constexpr (NORM) {
            float squares = 0.0f;
            for (int c = walk.lane * N; active && c < half; c += stride) {
                const Vec<T, N> a = load<T, N>(xr + c), b = load<T, N>(xr + half + c);
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    const float fa = to_float(a.v[k]), fb = to_float(b.v[k]);
                    squares += fa * fa + fb * fb;
                }
            }
            rstd = rsqrtf(group_sum(squares, group) / static_cast<float>(2 * half) + eps);
            if (active && walk.lane == 0)
                rstd_out[row] = rstd;
        }
        if (!active)
            continue;
        const int64_t tr = table_row(row, heads, seq, cos_batch) * half;
        T *yr = y + row * 2 * half;
        for (int c = walk.lane * N; c < half; c += stride) {
            const Vec<T, N> a = load<T, N>(xr + c), b = load<T, N>(xr + half + c);
            const Vec<T, N> cs = load<T, N>(cos + tr + c), sn = load<T, N>(sin + tr + c);
            Vec<T, N> wa, wb;
            if constexpr (NORM) {
                wa = load<T, N>(weight + c);
                wb = load<T, N>(weight + half + c);
            }
            Vec<T, N> oa, ob;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                float za = to_float(a.v[k]), zb = to_float(b.v[k]);
                if constexpr (NORM) {
                    // The norm's output is rounded as Hugging Face's q_norm/k_norm output is.
                    za = round_to<T>(to_float(wa.v[k]) * round_to<T>(za * rstd));
                    zb = round_to<T>(to_float(wb.v[k]) * round_to<T>(zb * rstd));
                }
                // Hugging Face rounds q*cos and rotate_half(q)*sin to the dtype before adding
                // them; here the rotation is fp32 and rounded once (two roundings fewer).
                const float c_ = to_float(cs.v[k]), s_ = to_float(sn.v[k]);
                oa.v[k] = from_float<T>(za * c_ - zb * s_);
                ob.v[k] = from_float<T>(zb * c_ + za * s_);
            }
            store<T, N>(yr + c, oa);
            store<T, N>(yr + half + c, ob);
        }
    }
}

template <typename T, int N, bool NORM, int ITERS>
__global__ void __launch_bounds__(kThreads)
    rope_backward_kernel(const T *__restrict__ dy, const T *__restrict__ x,
                         const T *__restrict__ weight, const float *__restrict__ rstd_in,
                         const T *__restrict__ cos, const T *__restrict__ sin,
                         T *__restrict__ dx, float *__restrict__ dweight_partial, int64_t rows,
                         int64_t heads, int64_t seq, int64_t cos_batch, int half, int group) {
    extern __shared__ float tile[]; // [groups per block][2 * half]: this block's dweight
    const RowWalk walk(group);
    const int head_dim = 2 * half;
    // The group's share of dweight: lane owns columns (lane + i * group) * N + k of each half.
    float dwa[ITERS][N], dwb[ITERS][N];
#pragma unroll
    for (int i = 0; i < ITERS; ++i)
#pragma unroll
        for (int k = 0; k < N; ++k)
            dwa[i][k] = dwb[i][k] = 0.0f;

    for (int64_t w0 = walk.warp0, row = walk.first; w0 < rows; w0 += walk.step, row += walk.step) {
        const bool active = row < rows;
        const int64_t tr = active ? table_row(row, heads, seq, cos_batch) * half : 0;
        const T *dyr = dy + row * head_dim, *xr = x + row * head_dim;
        T *dxr = dx + row * head_dim;
        const float rstd = NORM && active ? rstd_in[row] : 1.0f;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int c = (walk.lane + i * group) * N;
            if (!active || c >= half)
                continue;
            const Vec<T, N> ga = load<T, N>(dyr + c), gb = load<T, N>(dyr + half + c);
            const Vec<T, N> cs = load<T, N>(cos + tr + c), sn = load<T, N>(sin + tr + c);
            Vec<T, N> xa, xb, wa, wb, oa, ob;
            if constexpr (NORM) {
                xa = load<T, N>(xr + c);
                xb = load<T, N>(xr + half + c);
                wa = load<T, N>(weight + c);
                wb = load<T, N>(weight + half + c);
            }
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const float c_ = to_float(cs.v[k]), s_ = to_float(sn.v[k]);
                const float fa = to_float(ga.v[k]), fb = to_float(gb.v[k]);
                const float dza = fa * c_ + fb * s_, dzb = fb * c_ - fa * s_; // inverse rotation
                if constexpr (NORM) {
                    const float na = to_float(xa.v[k]) * rstd, nb = to_float(xb.v[k]) * rstd;
                    dot += dza * to_float(wa.v[k]) * na + dzb * to_float(wb.v[k]) * nb;
                    dwa[i][k] += dza * round_to<T>(na);
                    dwb[i][k] += dzb * round_to<T>(nb);
                } else {
                    oa.v[k] = from_float<T>(dza);
                    ob.v[k] = from_float<T>(dzb);
                }
            }
            if constexpr (!NORM) {
                store<T, N>(dxr + c, oa);
                store<T, N>(dxr + half + c, ob);
            }
        }
        if constexpr (NORM) {
            dot = group_sum(dot, group) / static_cast<float>(head_dim);
            // Second pass: the row (a few hundred bytes) is still in L1.
#pragma unroll
            for (int i = 0; i < ITERS; ++i) {
                const int c = (walk.lane + i * group) * N;
                if (!active || c >= half)
                    continue;
                const Vec<T, N> ga = load<T, N>(dyr + c), gb = load<T, N>(dyr + half + c);
                const Vec<T, N> cs = load<T, N>(cos + tr + c), sn = load<T, N>(sin + tr + c);
                const Vec<T, N> xa = load<T, N>(xr + c), xb = load<T, N>(xr + half + c);
                const Vec<T, N> wa = load<T, N>(weight + c), wb = load<T, N>(weight + half + c);
                Vec<T, N> oa, ob;
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    const float c_ = to_float(cs.v[k]), s_ = to_float(sn.v[k]);
                    const float fa = to_float(ga.v[k]), fb = to_float(gb.v[k]);
                    const float dza = fa * c_ + fb * s_, dzb = fb * c_ - fa * s_;
                    const float na = to_float(xa.v[k]) * rstd, nb = to_float(xb.v[k]) * rstd;
                    oa.v[k] = from_float<T>(rstd * (dza * to_float(wa.v[k]) - na * dot));
                    ob.v[k] = from_float<T>(rstd * (dzb * to_float(wb.v[k]) - nb * dot));
                }
                store<T, N>(dxr + c, oa);
                store<T, N>(dxr + half + c, ob);
            }
        }
    }
    if constexpr (NORM) {
        // Groups' shares -> the block's partial, summed in a fixed order (deterministic).
        const int groups = blockDim.x / group, g = threadIdx.x / group;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int c = (walk.lane + i * group) * N;
            if (c >= half)
                continue;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                tile[g * head_dim + c + k] = dwa[i][k];
                tile[g * head_dim + half + c + k] = dwb[i][k];
            }
        }
        __syncthreads();
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
            float s = 0.0f;
            for (int j = 0; j < groups; ++j)
                s += tile[j * head_dim + c];
            dweight_partial[static_cast<int64_t>(blockIdx.x) * head_dim + c] = s;
        }
    }
}

int forward_grid(int64_t rows, int group) {
    const int64_t rows_per_block = kThreads / group;
    const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
    return static_cast<int>(blocks < 1 ? 1 : (blocks < (1 << 30) ? blocks : (1 << 30)));
}

template <typename T, int N, bool NORM>
void launch_backward(const HeadPlan &plan, int blocks, cudaStream_t stream, const T *dy,
                     const T *x, const T *weight, const float *rstd, const T *cos, const T *sin,
                     T *dx, float *partial, int64_t rows, int64_t heads, int64_t seq,
                     int64_t cos_batch, int half) {
    const size_t tile = NORM ? sizeof(float) * (kThreads / plan.group) * 2 * half : 0;
    if (plan.iters == 1)
        rope_backward_kernel<T, N, NORM, 1><<<blocks, kThreads, tile, stream>>>(
            dy, x, weight, rstd, cos, sin, dx, partial, rows, heads, seq, cos_batch, half,
            plan.group);
    else
        rope_backward_kernel<T, N, NORM, 4><<<blocks, kThreads, tile, stream>>>(
            dy, x, weight, rstd, cos, sin, dx, partial, rows, heads, seq, cos_batch, half,
            plan.group);
}

} // namespace

cudaError_t rope_forward_cuda(ElemType type, const void *x, const void *weight, const void *cos,
                              const void *sin, void *y, float *rstd, int64_t rows, int64_t heads,
                              int64_t seq, int64_t cos_batch, int64_t head_dim, float eps,
                              cudaStream_t stream) {
    return with_elem_type(type, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        constexpr int vec = 16 / sizeof(T);
        HeadPlan plan;
        if (!plan_head<T>(head_dim, {x, weight, cos, sin, y}, plan))
            return cudaErrorNotSupported;
        if (rows == 0)
            return cudaSuccess;
        const int grid = forward_grid(rows, plan.group), half = static_cast<int>(head_dim / 2);
        const T *xt = static_cast<const T *>(x), *wt = static_cast<const T *>(weight),
                *ct = static_cast<const T *>(cos), *st = static_cast<const T *>(sin);
        T *yt = static_cast<T *>(y);
#define RP_LAUNCH(N, NORM)                                                                         \
    rope_forward_kernel<T, N, NORM><<<grid, kThreads, 0, stream>>>(                                \
        xt, wt, ct, st, yt, rstd, rows, heads, seq, cos_batch, half, plan.group, eps)
        if (plan.n == vec) {
            if (weight != nullptr)
                RP_LAUNCH(vec, true);
            else
                RP_LAUNCH(vec, false);
        } else if (weight != nullptr) {
            RP_LAUNCH(1, true);
        } else {
            RP_LAUNCH(1, false);
        }
#undef RP_LAUNCH
        return cudaGetLastError();
    });
}

cudaError_t rope_backward_cuda(ElemType type, const void *dy, const void *x, const void *weight,
                               const float *rstd, const void *cos, const void *sin, void *dx,
                               float *dweight_partial, int blocks, int64_t rows, int64_t heads,
                               int64_t seq, int64_t cos_batch, int64_t head_dim,
                               cudaStream_t stream) {
    return with_elem_type(type, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        constexpr int vec = 16 / sizeof(T);
        HeadPlan plan;
        if (!plan_head<T>(head_dim, {dy, x, weight, cos, sin, dx}, plan))
            return cudaErrorNotSupported;
        if (blocks <= 0)
            return cudaErrorInvalidValue;
        // Without the norm there is nothing to reduce: one pass, as many blocks as rows need.
        if (weight == nullptr)
            blocks = forward_grid(rows, plan.group);
        const int half = static_cast<int>(head_dim / 2);
        const T *g = static_cast<const T *>(dy), *xt = static_cast<const T *>(x),
                *wt = static_cast<const T *>(weight), *ct = static_cast<const T *>(cos),
                *st = static_cast<const T *>(sin);
        T *out = static_cast<T *>(dx);
        if (plan.n == vec) {
            if (weight != nullptr)
                launch_backward<T, vec, true>(plan, blocks, stream, g, xt, wt, rstd, ct, st, out,
                                              dweight_partial, rows, heads, seq, cos_batch, half);
            else
                launch_backward<T, vec, false>(plan, blocks, stream, g, xt, wt, rstd, ct, st, out,
                                               dweight_partial, rows, heads, seq, cos_batch,
                                               half);
        } else if (weight != nullptr) {
            launch_backward<T, 1, true>(plan, blocks, stream, g, xt, wt, rstd, ct, st, out,
                                        dweight_partial, rows, heads, seq, cos_batch, half);
        } else {
            launch_backward<T, 1, false>(plan, blocks, stream, g, xt, wt, rstd, ct, st, out,
                                         dweight_partial, rows, heads, seq, cos_batch, half);
        }
        return cudaGetLastError();
    });
}

} // namespace rp::kernels
