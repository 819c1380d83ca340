// CUDA launchers of the SwiGLU kernels (swiglu.cu): contiguous gate, up and outputs of `n`
// elements each, and a stream; swiglu.cpp checks the tensors and calls these.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/elem_type.h"

namespace rp::kernels {

// y = silu(gate) * up, in fp32 and rounded once. `max_blocks` caps the grid (the kernels are
// grid-stride loops).
cudaError_t swiglu_forward_cuda(ElemType type, const void *gate, const void *up, void *y,
                                int64_t n, int max_blocks, cudaStream_t stream);

// dgate = dy * up * silu'(gate), dup = dy * silu(gate), in fp32 and rounded once each.
cudaError_t swiglu_backward_cuda(ElemType type, const void *dy, const void *gate, const void *up,
                                 void *dgate, void *dup, int64_t n, int max_blocks,
                                 cudaStream_t stream);

} // namespace rp::kernels
