// CUDA launchers of the rotary-embedding kernels (rope.cu), with the optional per-head RMSNorm
// in front (Qwen3's q_norm / k_norm). Contiguous x [rows = batch * seq * heads, head_dim],
// cos/sin tables [cos_batch (1 or batch), seq, head_dim / 2], a stream; rope.cpp checks the
// tensors and calls these.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/elem_type.h"

namespace rp::kernels {

// With `weight` non-null each row is first normalised as rms_norm does (z = weight *
// round(x * rstd), rstd stored to `rstd`, fp32 [rows]); then the halves of z are rotated:
// y1 = z1 * cos - z2 * sin, y2 = z2 * cos + z1 * sin, in fp32, rounded once. Returns
// cudaErrorNotSupported, launching nothing, for a head_dim this kernel does not cover (odd, or
// over 1024).
cudaError_t rope_forward_cuda(ElemType type, const void *x, const void *weight, const void *cos,
                              const void *sin, void *y, float *rstd, int64_t rows, int64_t heads,
                              int64_t seq, int64_t cos_batch, int64_t head_dim, float eps,
                              cudaStream_t stream);

// The inverse rotation of dy (dz1 = dy1 * cos + dy2 * sin, dz2 = dy2 * cos - dy1 * sin), then,
// with `weight` non-null, the norm's backward: dx from x and the saved rstd, and per-block fp32
// partials of dweight [blocks, head_dim] (the caller sums them; a block that got no row writes
// zeros). Same cudaErrorNotSupported rule as the forward.
cudaError_t rope_backward_cuda(ElemType type, const void *dy, const void *x, const void *weight,
                               const float *rstd, const void *cos, const void *sin, void *dx,
                               float *dweight_partial, int blocks, int64_t rows, int64_t heads,
                               int64_t seq, int64_t cos_batch, int64_t head_dim,
                               cudaStream_t stream);

} // namespace rp::kernels
