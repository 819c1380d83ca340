#include "layers/transformer_layers.h"

#include "kernels/swiglu.h"
#include "layers/decoder_attention.h"
#include "layers/projection.h"

namespace rp {

ParamSpec normal_param(const std::string &name, std::vector<int64_t> shape, double std) {
    return {name, std::move(shape), std > 0 ? InitKind::Normal : InitKind::Zeros, std};
}

namespace {

class TokenEmbedding final : public Layer {
  public:
    TokenEmbedding(int64_t num, int64_t dim, double init_std) : num_(num) {
        params_.push_back(normal_param("weight", {num, dim}, init_std));
    }
    std::string type() const override { return "token_embedding"; }
    int64_t input_index_limit() const override { return vocab(); }
    bool looks_up_rows() const override { return true; }
    int64_t vocab() const { return num_; }
    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &ids,
                       const LayerContext &lc) const override {
        TORCH_CHECK_VALUE(!at::isFloatingType(ids.scalar_type()),
                          "token_embedding needs integer token ids, got ",
                          c10::toString(ids.scalar_type()));
        return at::embedding(p[0], ids, -1, false, embedding_row_gradient(lc, ids, p[0]));
    }
    double cost_estimate() const override { return 1024.0; } // a gather, not a matmul
    // Its backward keeps only the token ids (int64).
    double activation_bytes_per_token(double) const override { return 8.0; }

  private:
    int64_t num_;
};

class DecoderLayer final : public Layer {
  public:
    explicit DecoderLayer(const DecoderSpec &s) : s_(s), attn_(s, "decoder_layer") {
        // Hugging Face's module order, so the parameters list like a state dict.
        attn_.declare_projections(params_);
        gate_ =
            Projection(params_, LoraTarget::Gate, s.hidden, s.dim, s.mlp_bias, s.init_std, s.lora);
        up_ = Projection(params_, LoraTarget::Up, s.hidden, s.dim, s.mlp_bias, s.init_std, s.lora);
        down_ =
            Projection(params_, LoraTarget::Down, s.dim, s.hidden, s.mlp_bias, s.init_std, s.lora);
        attn_.declare_norms(params_);
        if (s.lora.enabled())
            freeze_all_but_adapters(params_);
    }

    std::string type() const override { return "decoder_layer"; }

    // What autograd keeps of forward() below per token on the fused path (every float, bf16 and
    // fp16 model): the attention half's terms (DecoderAttention::activation_bytes_per_token),
    // then the MLP's: gate and up (kept by SwiGLU, which recomputes silu) and SwiGLU's output
    // (kept by down_proj): 3e h, with e = dtype_bytes and h = hidden; and the MLP adapters'.
    // Qwen3-1.7B in bf16: 72,104 bytes, 4.4 GiB per layer for 65,536 tokens. The unfused path
    // (other dtypes) keeps more (fp32 norm copies, silu's output: 113,216 bytes for the same
    // shape), and with an attention mask the keys and values are repeated to every head and a
    // [seq, seq] mask is made, which this per-token figure does not count.
    double activation_bytes_per_token(double e) const override {
        return attn_.activation_bytes_per_token(e) + 3.0 * e * static_cast<double>(s_.hidden) +
               gate_.adapter_bytes(e, s_.lora) + up_.adapter_bytes(e, s_.lora) +
               down_.adapter_bytes(e, s_.lora);
    }

    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &ctx) const override {
        const DecoderAttention::Output a = attn_.forward(p, x, ctx);
        // SwiGLU rounds once where the unfused expression rounds each product
        // (src/kernels/swiglu.cu).
        at::Tensor gate = gate_(a.normed, p, s_.lora, ctx), up = up_(a.normed, p, s_.lora, ctx);
        at::Tensor mlp = attn_.fusable(x, p) ? kernels::swiglu(gate, up) : at::silu(gate) * up;
        return a.residual + down_(mlp, p, s_.lora, ctx);
    }

  private:
    DecoderSpec s_;
    DecoderAttention attn_;
    Projection gate_, up_, down_;
};

} // namespace

std::unique_ptr<Layer> make_token_embedding(int64_t num, int64_t dim, double init_std) {
    return std::make_unique<TokenEmbedding>(num, dim, init_std);
}

std::unique_ptr<Layer> make_decoder_layer(const DecoderSpec &spec) {
    return std::make_unique<DecoderLayer>(spec);
}

} // namespace rp
