// The experts of a mixture-of-experts MLP (Qwen3-MoE): each token's hidden state goes through
// the SwiGLU experts its router chose, and the expert outputs are summed with the routing
// weights. This is transformers' Qwen3MoeExperts.forward; the GEMMs are grouped by expert, never
// run per token.
#pragma once
#include <ATen/ATen.h>

namespace rp::kernels {

// How the expert GEMMs run. Both sort the (token, slot) pairs by expert, so each expert's rows
// are one contiguous slice.
enum class ExpertGemms {
    Auto,    // Grouped for bfloat16 on CUDA devices when the sizes allow it, else Loop
    Loop,    // one GEMM per non-empty expert over its slice (reads the slice sizes on the host)
    Grouped, // one at::_grouped_mm over all experts per projection (no host synchronisation)
};

// Whether Auto takes the grouped GEMM for these tensors: bfloat16 on a CUDA device (on other
// GPUs than Hopper and Blackwell ATen runs it as a loop of GEMMs itself), with row strides of
// whole 16-byte units (hidden and expert widths multiples of 8) as the kernel requires.
bool grouped_gemm_applies(const at::Tensor &x, const at::Tensor &gate_up);

// x [tokens, hidden]; experts [tokens, k] (int64, values in [0, num_experts)); weights
// [tokens, k] in x's dtype; gate_up [num_experts, 2 * expert_hidden, hidden] (each expert's
// gate_proj rows, then its up_proj rows); down [num_experts, hidden, expert_hidden]. All on x's
// device, weights in x's dtype. Returns [tokens, hidden] in x's dtype:
//   y[t] = sum over slots j of weights[t, j] * down[e] @ (silu(g) * u),
//          (g, u) = the two halves of gate_up[e] @ x[t], e = experts[t, j]
// Each (token, slot) product is rounded to x's dtype before the sum over slots, as transformers
// rounds it; the sum runs over the slots in one reduction (fp32 accumulation), in a fixed order.
// Differentiable in x, weights, gate_up and down; the backward has no atomic accumulation, so
// it is deterministic on GPUs too.
at::Tensor moe_experts(const at::Tensor &x, const at::Tensor &experts, const at::Tensor &weights,
                       const at::Tensor &gate_up, const at::Tensor &down,
                       ExpertGemms gemms = ExpertGemms::Auto);

} // namespace rp::kernels
