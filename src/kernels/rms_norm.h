// Fused RMSNorm for the decoder layers: Hugging Face's LlamaRMSNorm / Qwen3RMSNorm, alone and
// fused with the residual add before it, as autograd functions (CUDA kernels on GPUs, the ATen
// twin of the same math elsewhere).
#pragma once
#include <utility>

#include <ATen/ATen.h>

namespace rp::kernels {

// weight * round(x * rsqrt(mean(x^2) + eps)) over the last dimension, the mean and rsqrt in fp32
// and round() to x's dtype, exactly Hugging Face's rounding points. x: any shape, float32,
// bfloat16 or float16 (made contiguous if it is not); weight: [x.size(-1)], x's dtype and
// device. Differentiable in x and weight; weight's gradient is reduced in fp32.
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps);

// {sum, rms_norm(sum, weight, eps)} with sum = x + residual in x's dtype: the decoder's
// `out = x + o_proj(attn); h2 = post_attention_layernorm(out)` in one pass over the rows.
// residual: x's shape, dtype and device. Differentiable in x, residual and weight.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x, const at::Tensor &residual,
                                               const at::Tensor &weight, double eps);

} // namespace rp::kernels
