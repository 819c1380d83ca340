// The mixture-of-experts decoder layer of Qwen3-MoE: the decoder layer's attention half, then a
// sparse MLP (transformers' Qwen3MoeSparseMoeBlock): a router picks each token's top-k experts
// and the SwiGLU experts' outputs are summed with the routing weights. docs/semantics.md,
// "Mixture-of-experts decoder layer".
#include <tuple>

#include "base/error.h"
#include "kernels/moe_experts.h"
#include "layers/decoder_attention.h"
#include "layers/projection.h"
#include "layers/transformer_layers.h"

namespace rp {
namespace {

class MoeDecoderLayer final : public Layer {
  public:
    MoeDecoderLayer(const DecoderSpec &s, const MoeSpec &m)
        : s_(s), m_(m), attn_(s, "moe_decoder_layer") {
        // Hugging Face's module order and its in-memory layout (transformers 5): the experts'
        // weights stacked, gate_proj and up_proj of each expert in one [2 * expert_hidden,
        // hidden] block, then the router.
        attn_.declare_projections(params_);
        gate_up_ = add(normal_param("mlp.experts.gate_up_proj",
                                    {m.experts, 2 * m.expert_hidden, s.dim}, s.init_std));
        down_ = add(
            normal_param("mlp.experts.down_proj", {m.experts, s.dim, m.expert_hidden}, s.init_std));
        router_ = add(normal_param("mlp.gate.weight", {m.experts, s.dim}, s.init_std));
        attn_.declare_norms(params_);
        if (s.lora.enabled())
            freeze_all_but_adapters(params_);
    }

    std::string type() const override { return "moe_decoder_layer"; }

    // The planner balances compute: a token runs the attention half, the router and top_k of
    // the experts, so the experts count at top_k / experts of their size.
    double cost_estimate() const override {
        const double all = Layer::cost_estimate();
        const double experts = 3.0 * static_cast<double>(m_.experts) *
                               static_cast<double>(m_.expert_hidden) * static_cast<double>(s_.dim);
        const double used = static_cast<double>(m_.top_k) / static_cast<double>(m_.experts);
        return all - (1.0 - used) * experts;
    }

    // The attention half's bytes (DecoderAttention), then what autograd keeps of the sparse MLP
    // per token, with d = dim, k = top_k, i = expert_hidden, e = dtype_bytes, f = 4 (fp32) and
    // int64 indices of 8 bytes: the router's fp32 probabilities (softmax's output) f experts;
    // top-k's indices 8k and, with norm_topk_prob, the division's operands f k + f; the sort
    // order and its inverse 2 * 8k; the expert rows (the first GEMM's input) e k d; the gate/up
    // output kept by SwiGLU 2e k i and its output kept by the second GEMM e k i; the expert
    // outputs and the sorted weights kept by the weighting e k d + e k. Qwen3-30B-A3B in bf16:
    // 44,568 + 103,156 bytes.
    double activation_bytes_per_token(double e) const override {
        const double f = 4.0, index = 8.0, d = static_cast<double>(s_.dim);
        const double k = static_cast<double>(m_.top_k), i = static_cast<double>(m_.expert_hidden);
        const double router = f * static_cast<double>(m_.experts) + index * k +
                              (m_.norm_topk_prob ? f * k + f : 0.0) + 2.0 * index * k;
        const double experts = e * k * d + 3.0 * e * k * i + e * k * d + e * k;
        return attn_.activation_bytes_per_token(e) + router + experts;
    }

    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &ctx) const override {
        const DecoderAttention::Output a = attn_.forward(p, x, ctx);
        const at::Tensor h = a.normed.reshape({-1, s_.dim});
        // transformers' Qwen3MoeTopKRouter: logits in the compute dtype, softmax and top-k in
        // fp32, the chosen probabilities renormalised in fp32, then rounded to the compute dtype.
        const at::Tensor logits = at::linear(h, p[router_]);
        at::Tensor top, experts;
        std::tie(top, experts) = at::softmax(logits, -1, at::kFloat).topk(m_.top_k, -1);
        if (m_.norm_topk_prob)
            top = top / top.sum(-1, /*keepdim=*/true);
        const at::Tensor y =
            kernels::moe_experts(h, experts, top.to(logits.scalar_type()), p[gate_up_], p[down_]);
        return a.residual + y.view(a.residual.sizes());
    }

  private:
    int add(ParamSpec spec) {
        params_.push_back(std::move(spec));
        return static_cast<int>(params_.size() - 1);
    }

    DecoderSpec s_;
    MoeSpec m_;
    DecoderAttention attn_;
    int gate_up_ = -1, down_ = -1, router_ = -1;
};

} // namespace

std::unique_ptr<Layer> make_moe_decoder_layer(const DecoderSpec &spec, const MoeSpec &moe) {
    require(moe.experts > 0 && moe.top_k > 0 && moe.top_k <= moe.experts && moe.expert_hidden > 0,
            "moe_decoder_layer needs 1 <= top_k <= experts and expert_hidden > 0");
    require(!spec.mlp_bias, "moe_decoder_layer: the experts have no biases");
    require(!spec.lora.enabled() || (spec.lora.targets & ~kLoraAttentionTargets) == 0,
            "moe_decoder_layer: LoRA adapters exist on the attention projections only");
    return std::make_unique<MoeDecoderLayer>(spec, moe);
}

} // namespace rp
