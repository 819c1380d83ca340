// The attention half of a decoder layer, shared by the dense decoder layer and the
// mixture-of-experts one: the input RMSNorm, the q/k/v projections (with their adapters), q/k
// norms and RoPE, causal grouped-query attention, the output projection, the residual add and the
// post-attention RMSNorm that the MLP reads. docs/semantics.md, "Transformer layers".
#pragma once
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "engine/layer.h"
#include "layers/projection.h"
#include "layers/transformer_layers.h" // DecoderSpec

namespace rp {

class DecoderAttention {
  public:
    // `layer` is the owning layer's type, for messages.
    DecoderAttention(const DecoderSpec &spec, std::string layer);

    // Hugging Face lists a decoder layer's modules as self_attn, mlp, input_layernorm,
    // post_attention_layernorm: the layer declares its MLP between these two calls, so that its
    // parameters list like a state dict.
    void declare_projections(std::vector<ParamSpec> &params); // q, k, v, o, q_norm, k_norm
    void declare_norms(std::vector<ParamSpec> &params);       // the two layer norms

    struct Output {
        at::Tensor residual; // x + attention(rms(x, input_layernorm))
        at::Tensor normed;   // rms(residual, post_attention_layernorm): the MLP's input
    };
    // x [batch, seq, dim]; the side inputs of `ctx` carry the attention mask and position ids.
    Output forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                   const LayerContext &ctx) const;

    // Whether the fused kernels (src/kernels/) serve these activations and norm weights: float32,
    // bfloat16 and float16 with the norm weights in the activations' dtype. Other models
    // (float64, weights kept in another dtype) run the unfused expressions.
    bool fusable(const at::Tensor &x, const std::vector<at::Tensor> &p) const;

    // What autograd keeps of forward() per token on the fused path (DecoderLayer's
    // activation_bytes_per_token lists the terms), adapters included.
    double activation_bytes_per_token(double dtype_bytes) const;

  private:
    void rotary(const at::Tensor &positions, int64_t b, int64_t t, const at::Tensor &x,
                at::Tensor &cos, at::Tensor &sin) const;
    at::Tensor repeat_kv(const at::Tensor &x) const;

    DecoderSpec s_;
    std::string layer_;
    at::Tensor inv_freq_; // fp32 CPU constant, never trained
    Projection q_, k_, v_, o_;
    int q_norm_ = -1, k_norm_ = -1;
    int in_norm_ = -1, post_norm_ = -1;
};

} // namespace rp
