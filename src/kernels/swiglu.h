// Fused SwiGLU for the decoder's MLP, silu(gate_proj(h)) * up_proj(h), as an autograd function
// (CUDA kernels on GPUs, the ATen twin of the same math elsewhere).
#pragma once
#include <ATen/ATen.h>

namespace rp::kernels {

// silu(gate) * up, computed in fp32 and rounded once to the inputs' dtype (Hugging Face's
// expression rounds silu(gate) too). gate and up: the same shape, dtype (float32, bfloat16 or
// float16) and device; non-contiguous inputs are copied. Differentiable in both; its backward
// produces both gradients in one pass.
at::Tensor swiglu(const at::Tensor &gate, const at::Tensor &up);

} // namespace rp::kernels
