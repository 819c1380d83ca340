// CUDA launchers of the RMSNorm kernels (rms_norm.cu). Raw pointers to contiguous row-major
// [rows, dim] data and a stream; rms_norm.cpp checks the tensors and calls these.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/elem_type.h"

namespace rp::kernels {

// y = weight * round(x * rstd) per row of `dim`, rstd = 1 / sqrt(mean(x^2) + eps) in fp32,
// stored to `rstd` (fp32, [rows]). With `residual` non-null, x is first replaced by
// sum = round(x + residual), which is stored to `sum`. Returns cudaErrorNotSupported, having
// launched nothing, when a row is too long for the register-resident kernel (more than 8192
// 16-byte vectors); the caller then uses the ATen twin.
cudaError_t rms_norm_forward_cuda(ElemType type, const void *x, const void *residual,
                                  const void *weight, void *sum, void *y, float *rstd,
                                  int64_t rows, int64_t dim, float eps, cudaStream_t stream);

// dx = rstd * (dn - n * mean(dn * n)) + dsum with n = x * rstd and dn = dy * weight, and per-block
// partial weight gradients dweight_partial[b] = sum over the rows block b handled of
// dy * round(n), fp32 [blocks, dim] (the caller sums them). `x` is what was normalised (the sum,
// in the residual variant); `dsum` (nullable) is the gradient reaching the stored sum directly.
// `blocks` is the grid size the caller allocated partials for (at most `rows` are used; unused
// rows of the partials are written as zeros).
cudaError_t rms_norm_backward_cuda(ElemType type, const void *dy, const void *dsum,
                                   const void *x, const void *weight, const float *rstd,
                                   void *dx, float *dweight_partial, int blocks, int64_t rows,
                                   int64_t dim, cudaStream_t stream);

} // namespace rp::kernels
