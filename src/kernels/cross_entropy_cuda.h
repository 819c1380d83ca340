// The CUDA side of kernels/cross_entropy.h: raw pointers, sizes and a stream, so that nvcc never
// compiles an ATen header. Only kernels/cross_entropy.cpp calls it, after checking the tensors.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

namespace rp {
namespace kernels {

enum class CrossEntropyDtype { Float32, BFloat16, Float16 };

// `logits`: `rows` rows of `vocab` elements of `dtype`, row r starting at element r *
// `row_stride` (unit stride inside a row, any alignment); `targets`: `rows` int64 values;
// `loss`: `rows` floats written. With `write_grad`, each row of logits is overwritten with its
// gradient. Enqueues one kernel on `stream` and returns the launch's error (cudaSuccess when
// `rows` is 0); the kernel's own faults surface at the stream's next synchronisation.
cudaError_t cross_entropy_cuda(void *logits, const int64_t *targets, float *loss, int64_t rows,
                               int64_t vocab, int64_t row_stride, CrossEntropyDtype dtype,
                               int64_t ignore_index, bool write_grad, cudaStream_t stream);

} // namespace kernels
} // namespace rp
