// CUDA version of kernels/cross_entropy.h: one thread block per row of logits.
//
// A row is read twice and written once: pass 1 finds the row maximum and the sum of exp(x - max)
// together (the online softmax recurrence, so the row is read once for both) and, in thread 0,
// the target's logit; pass 2 writes the gradient over the logits. A Qwen3 row (151,936 bf16
// logits, 297 KiB) is too large for shared memory or registers, so pass 2 reads it again from L2
// or memory; the kernel is bandwidth bound, a few percent of the GEMMs around it.
//
// Loads and stores are 16 bytes wide over the aligned body of each row, with scalar loops for
// the unaligned head and the ragged tail, so any vocabulary size and any row stride work (rows
// of an odd vocabulary start at any 2-byte boundary).
#include "kernels/cross_entropy_cuda.h"

#include <cfloat>
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace rp {
namespace kernels {
namespace {

constexpr int kThreads = 512; // 16 warps: enough loads in flight per row, 4 rows per SM
constexpr int kWarps = kThreads / 32;
constexpr int kVecBytes = 16;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Round to nearest even, as at::Tensor::to does.
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}

// 16 bytes of elements; the alignment makes the compiler emit one vector load or store.
template <typename T> struct alignas(kVecBytes) Vec {
    static constexpr int kSize = kVecBytes / static_cast<int>(sizeof(T));
    T v[kSize];
};

// Running (max, sum of exp(x - max)) pairs. The maximum starts at -FLT_MAX rather than -inf so
// that a -inf logit (a masked token) contributes exp(-inf) = 0 instead of exp(-inf + inf) = NaN.
// A NaN logit makes the sum NaN (fmaxf skips it, the exp does not), so it reaches the loss as
// it does in ATen; an +inf logit gives NaN as in ATen.
//
// The sum is compensated (Kahan): the thread that holds a confident token's logit carries
// exp(0) = 1 and then adds hundreds of terms below fp32's half-ulp of 1, which plain addition
// drops one by one (on a 151,936-token vocabulary the loss was off by 2e-5, ten times fp32's
// rounding, against ATen's tree-shaped sums).
struct MaxSum {
    float m = -FLT_MAX;
    float s = 0.0f;
    float c = 0.0f; // what the additions to s lost, negated

    __device__ __forceinline__ void add(float term) {
        const float y = term - c;
        const float t = s + y;
        c = (t - s) - y;
        s = t;
    }
    __device__ __forceinline__ void rescale_to(float new_max) {
        const float f = expf(m - new_max);
        s *= f;
        c *= f;
        m = new_max;
    }
    // The compensated value, for handing to another thread.
    __device__ __forceinline__ float value() const { return s - c; }
    __device__ __forceinline__ void merge(float m2, float s2) {
        const float mm = fmaxf(m, m2);
        rescale_to(mm);
        add(s2 * expf(m2 - mm));
    }
};

// Elements [0, head) precede the first 16-byte boundary of the row; [head, head + nvec * kSize)
// is the vector body; the rest is the tail.
template <typename T> struct RowSplit {
    int64_t head;
    int64_t nvec;
    int64_t tail;

    __device__ RowSplit(const T *row, int64_t vocab) {
        const uintptr_t addr = reinterpret_cast<uintptr_t>(row);
        if (addr % sizeof(T) != 0) {
            head = vocab; // never for a tensor's storage; scalar code is still correct
        } else {
            const int64_t to_boundary =
                static_cast<int64_t>((kVecBytes - addr % kVecBytes) % kVecBytes / sizeof(T));
            head = to_boundary < vocab ? to_boundary : vocab;
        }
        nvec = (vocab - head) / Vec<T>::kSize;
        tail = head + nvec * Vec<T>::kSize;
    }
};

// The block's combined (max, sum), returned to every thread. Ends with the block synchronised,
// so `shared` may be reused after it.
__device__ MaxSum block_reduce(MaxSum local, float2 *shared) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, local.m, offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, local.value(), offset);
        local.merge(m2, s2);
    }
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    if (lane == 0)
        shared[warp] = make_float2(local.m, local.value());
    __syncthreads();
    if (warp == 0) {
        MaxSum r;
        if (lane < kWarps) {
            r.m = shared[lane].x;
            r.s = shared[lane].y;
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, r.m, offset);
            const float s2 = __shfl_xor_sync(0xffffffffu, r.value(), offset);
            r.merge(m2, s2);
        }
        if (lane == 0)
            shared[kWarps] = make_float2(r.m, r.value());
    }
    __syncthreads();
    MaxSum total;
    total.m = shared[kWarps].x;
    total.s = shared[kWarps].y;
    __syncthreads(); // everyone has read shared[kWarps] before the next row overwrites it
    return total;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(T *__restrict__ logits, const int64_t *__restrict__ targets,
                         float *__restrict__ loss, int64_t rows, int64_t vocab, int64_t row_stride,
                         int64_t ignore_index, bool write_grad) {
    __shared__ float2 shared[kWarps + 1];
    constexpr int kSize = Vec<T>::kSize;
    const int64_t tid = threadIdx.x;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        T *row = logits + r * row_stride; // 64-bit: rows * vocab passes 2^31 for large chunks
        const int64_t target = targets[r];
        const RowSplit<T> split(row, vocab);
        Vec<T> *body = reinterpret_cast<Vec<T> *>(row + split.head);

        if (target == ignore_index) { // uniform across the block
            if (tid == 0)
                loss[r] = 0.0f;
            if (write_grad) {
                Vec<T> zero;
                for (int k = 0; k < kSize; ++k)
                    zero.v[k] = from_float<T>(0.0f);
                for (int64_t j = tid; j < split.head; j += kThreads)
                    row[j] = zero.v[0];
                for (int64_t i = tid; i < split.nvec; i += kThreads)
                    body[i] = zero;
                for (int64_t j = split.tail + tid; j < vocab; j += kThreads)
                    row[j] = zero.v[0];
            }
            continue; // no shared memory was touched
        }
        const bool in_range = target >= 0 && target < vocab;
        // Only thread 0 uses it; read before any thread of the block writes the row (the
        // reduction below synchronises the block).
        float target_logit = 0.0f;
        if (tid == 0)
            target_logit = in_range ? to_float(row[target]) : __int_as_float(0x7fc00000);

        // Pass 1: at most one rescale of the running sum per vector.
        MaxSum acc;
        for (int64_t j = tid; j < split.head; j += kThreads)
            acc.merge(to_float(row[j]), 1.0f);
        for (int64_t i = tid; i < split.nvec; i += kThreads) {
            const Vec<T> v = body[i];
            float x[kSize];
            float vmax = -FLT_MAX;
            for (int k = 0; k < kSize; ++k) {
                x[k] = to_float(v.v[k]);
                vmax = fmaxf(vmax, x[k]);
            }
            if (vmax > acc.m)
                acc.rescale_to(vmax);
            for (int k = 0; k < kSize; ++k)
                acc.add(expf(x[k] - acc.m));
        }
        for (int64_t j = split.tail + tid; j < vocab; j += kThreads)
            acc.merge(to_float(row[j]), 1.0f);
        const MaxSum total = block_reduce(acc, shared);
        const float max = total.m;
        const float log_sum = logf(total.s);
        // As ATen's log_softmax: log p = (x - max) - log(sum); the loss is -log p[target].
        if (tid == 0)
            loss[r] = (max - target_logit) + log_sum;
        if (!write_grad)
            continue;

        // Pass 2: softmax - one_hot, in fp32, rounded once. A target out of range poisons the
        // row's gradient with NaN as it does the loss, so a step cannot silently use it.
        const float poison = in_range ? 0.0f : __int_as_float(0x7fc00000);
        auto grad = [&](float x, int64_t j) {
            return expf((x - max) - log_sum) - (j == target ? 1.0f : 0.0f) + poison;
        };
        for (int64_t j = tid; j < split.head; j += kThreads)
            row[j] = from_float<T>(grad(to_float(row[j]), j));
        for (int64_t i = tid; i < split.nvec; i += kThreads) {
            Vec<T> v = body[i];
            const int64_t j0 = split.head + i * kSize;
            for (int k = 0; k < kSize; ++k)
                v.v[k] = from_float<T>(grad(to_float(v.v[k]), j0 + k));
            body[i] = v;
        }
        for (int64_t j = split.tail + tid; j < vocab; j += kThreads)
            row[j] = from_float<T>(grad(to_float(row[j]), j));
    }
}

template <typename T>
cudaError_t launch(void *logits, const int64_t *targets, float *loss, int64_t rows, int64_t vocab,
                   int64_t row_stride, int64_t ignore_index, bool write_grad, cudaStream_t stream) {
    const unsigned grid = static_cast<unsigned>(rows < INT_MAX ? rows : INT_MAX);
    cross_entropy_kernel<T><<<grid, kThreads, 0, stream>>>(
        static_cast<T *>(logits), targets, loss, rows, vocab, row_stride, ignore_index, write_grad);
    return cudaGetLastError();
}

} // namespace

cudaError_t cross_entropy_cuda(void *logits, const int64_t *targets, float *loss, int64_t rows,
                               int64_t vocab, int64_t row_stride, CrossEntropyDtype dtype,
                               int64_t ignore_index, bool write_grad, cudaStream_t stream) {
    if (rows == 0)
        return cudaSuccess;
    switch (dtype) {
    case CrossEntropyDtype::Float32:
        return launch<float>(logits, targets, loss, rows, vocab, row_stride, ignore_index,
                             write_grad, stream);
    case CrossEntropyDtype::BFloat16:
        return launch<__nv_bfloat16>(logits, targets, loss, rows, vocab, row_stride, ignore_index,
                                     write_grad, stream);
    case CrossEntropyDtype::Float16:
        return launch<__half>(logits, targets, loss, rows, vocab, row_stride, ignore_index,
                              write_grad, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace kernels
} // namespace rp
