// Fused rotary position embedding for the decoder's queries and keys, with Qwen3's per-head
// RMSNorm (q_norm / k_norm) in front when it has one, as an autograd function (CUDA kernels on
// GPUs, the ATen twin of the same math elsewhere).
#pragma once
#include <ATen/ATen.h>

namespace rp::kernels {

// Hugging Face's apply_rotary_pos_emb for one of q or k, before the transpose to
// [batch, heads, seq, head_dim]: x [batch, seq, heads, head_dim] (as the projection's view
// gives it; copied if not contiguous), z = rms_norm(x, norm_weight, eps) over each head when
// norm_weight ([head_dim], x's dtype) is defined, else z = x, and the result
// z * cos + rotate_half(z) * sin in x's layout. cos and sin: [1 or batch, seq, head_dim / 2],
// x's dtype and device: the first half of Hugging Face's tables (the second repeats it), so
// cos(position * inv_freq) computed in fp32 and rounded to the dtype. Differentiable in x and
// norm_weight (the tables are constants).
at::Tensor rope(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin,
                const at::Tensor &norm_weight, double eps);

} // namespace rp::kernels
