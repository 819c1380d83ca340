// kernels/cross_entropy.h: argument checks, the CPU twin, and the dispatch to the CUDA kernel
// (kernels/cross_entropy.cu). The twin follows the CUDA kernel's formulas step for step (fp32
// maximum, sum of exp(x - max), log p = (x - max) - log(sum)) so both devices give the same
// losses and gradients up to the order of the fp32 sum.
#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#ifdef RP_KERNELS_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/cross_entropy_cuda.h"
#endif

namespace rp {
namespace kernels {
namespace {

template <typename T>
void cross_entropy_cpu(T *logits, const int64_t *targets, float *loss, int64_t rows, int64_t vocab,
                       int64_t row_stride, int64_t ignore_index, bool write_grad) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    // Rows are independent; a grain of a few rows keeps small vocabularies from paying more for
    // the threads than for the work.
    const int64_t grain = std::max<int64_t>(1, 65536 / vocab);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            T *row = logits + r * row_stride;
            const int64_t target = targets[r];
            if (target == ignore_index) {
                loss[r] = 0.0f;
                if (write_grad)
                    std::fill(row, row + vocab, T(0.0f));
                continue;
            }
            const bool in_range = target >= 0 && target < vocab;
            const float target_logit = in_range ? static_cast<float>(row[target]) : nan;
            // -FLT_MAX, not -inf, and comparisons that skip NaN: as the CUDA kernel, so a -inf
            // logit adds 0 and a NaN logit turns the sum (not the maximum) into NaN.
            float max = -FLT_MAX;
            for (int64_t j = 0; j < vocab; ++j) {
                const float x = static_cast<float>(row[j]);
                max = x > max ? x : max;
            }
            // Sixteen partial sums: a shorter dependency chain and a smaller rounding error than
            // one running sum over 151,936 terms.
            constexpr int kLanes = 16;
            float partial[kLanes] = {};
            for (int64_t j = 0; j < vocab; ++j)
                partial[j % kLanes] += std::exp(static_cast<float>(row[j]) - max);
            float sum = 0.0f;
            for (float p : partial)
                sum += p;
            const float log_sum = std::log(sum);
            loss[r] = (max - target_logit) + log_sum;
            if (!write_grad)
                continue;
            const float poison = in_range ? 0.0f : nan;
            for (int64_t j = 0; j < vocab; ++j) {
                const float x = static_cast<float>(row[j]);
                const float g =
                    std::exp((x - max) - log_sum) - (j == target ? 1.0f : 0.0f) + poison;
                row[j] = T(g); // c10::BFloat16 and c10::Half round to nearest even
            }
        }
    });
}

} // namespace

at::Tensor cross_entropy_(at::Tensor &logits, const at::Tensor &targets, int64_t ignore_index,
                          bool write_grad) {
    TORCH_CHECK_VALUE(logits.dim() == 2, "cross_entropy: logits must be [tokens, vocab], got ",
                      logits.sizes());
    TORCH_CHECK_VALUE(targets.dim() == 1 && targets.size(0) == logits.size(0),
                      "cross_entropy: targets must be [", logits.size(0), "], got ",
                      targets.sizes());
    TORCH_CHECK_VALUE(targets.scalar_type() == at::kLong, "cross_entropy: targets must be int64");
    const at::ScalarType dtype = logits.scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                      "cross_entropy: logits must be fp32, bf16 or fp16, got ", dtype);
    TORCH_CHECK_VALUE(logits.device() == targets.device(), "cross_entropy: logits on ",
                      logits.device(), " but targets on ", targets.device());
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    TORCH_CHECK_VALUE(vocab >= 1, "cross_entropy: the vocabulary is empty");
    // Unit stride along the vocabulary for the vector loads, and rows that do not overlap,
    // since the gradient is written over them.
    TORCH_CHECK_VALUE(vocab == 1 || logits.stride(1) == 1,
                      "cross_entropy: logits need unit stride along the vocabulary, got strides ",
                      logits.strides());
    TORCH_CHECK_VALUE(rows <= 1 || logits.stride(0) >= vocab,
                      "cross_entropy: rows of logits overlap (strides ", logits.strides(), ")");
    at::Tensor t = targets.contiguous();
    at::Tensor loss = at::empty({rows}, logits.options().dtype(at::kFloat));
    if (rows == 0)
        return loss;
    const int64_t row_stride = rows == 1 ? vocab : logits.stride(0);

    if (logits.is_cuda()) {
#ifdef RP_KERNELS_HAVE_CUDA
        const c10::cuda::CUDAGuard guard(logits.device());
        const CrossEntropyDtype kind = dtype == at::kFloat      ? CrossEntropyDtype::Float32
                                       : dtype == at::kBFloat16 ? CrossEntropyDtype::BFloat16
                                                                : CrossEntropyDtype::Float16;
        const cudaError_t err =
            cross_entropy_cuda(logits.data_ptr(), t.data_ptr<int64_t>(), loss.data_ptr<float>(),
                               rows, vocab, row_stride, kind, ignore_index, write_grad,
                               at::cuda::getCurrentCUDAStream(logits.device().index()).stream());
        TORCH_CHECK(err == cudaSuccess,
                    "cross_entropy: CUDA kernel launch failed: ", cudaGetErrorString(err));
        return loss;
#else
        TORCH_CHECK(false, "cross_entropy: this build of the kernels has no CUDA support");
#endif
    }
    TORCH_CHECK_VALUE(logits.is_cpu(), "cross_entropy: unsupported device ", logits.device());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "cross_entropy_cpu", [&] {
        cross_entropy_cpu<scalar_t>(logits.data_ptr<scalar_t>(), t.data_ptr<int64_t>(),
                                    loss.data_ptr<float>(), rows, vocab, row_stride, ignore_index,
                                    write_grad);
    });
    return loss;
}

} // namespace kernels
} // namespace rp
