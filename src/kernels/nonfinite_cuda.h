// CUDA launcher of the non-finite check (nonfinite.cu): `n` contiguous elements, a float64
// `flag` the caller has zeroed, a stream; nonfinite.cpp checks the tensor and calls this.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/elem_type.h"

namespace rp::kernels {

// Sets *flag to +inf when any of the n elements at `data` is inf or nan; leaves it otherwise.
// `max_blocks` caps the grid (a grid-stride loop).
cudaError_t nonfinite_flag_cuda(ElemType type, const void *data, int64_t n, double *flag,
                                int max_blocks, cudaStream_t stream);

} // namespace rp::kernels
