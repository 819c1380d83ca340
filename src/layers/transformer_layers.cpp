#include "layers/transformer_layers.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace rp {

ParamSpec normal_param(const std::string &name, std::vector<int64_t> shape, double std) {
    return {name, std::move(shape), std > 0 ? InitKind::Normal : InitKind::Zeros, std};
}

namespace {

// Hugging Face's LlamaRMSNorm / Qwen3RMSNorm: normalise in fp32, round to the input dtype, then
// scale. This and the other unfused expressions below serve the dtypes the fused kernels
// (src/kernels/) have no code for; tests/kernels checks the kernels against them.
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    at::Tensor xf = x.to(at::kFloat);
    at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
    return weight * normed.to(x.scalar_type());
}

at::Tensor linear(const at::Tensor &x, const std::vector<at::Tensor> &p, int weight, int bias) {
    return bias >= 0 ? at::linear(x, p[weight], p[bias]) : at::linear(x, p[weight]);
}

at::Tensor rotate_half(const at::Tensor &x) {
    const int64_t half = x.size(-1) / 2;
    return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Inverse frequencies of the rotary embedding, computed with the same fp32 CPU operations as
// transformers' rope initialisers so that positions rotate by bit-identical angles.
at::Tensor inverse_frequencies(const RopeSpec &rope, int64_t head_dim) {
    at::Tensor exponent = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kFloat)) /
                          static_cast<double>(head_dim);
    at::Tensor inv = at::pow(rope.theta, exponent).reciprocal();
    if (rope.type == "linear")
        return inv / rope.factor;
    if (rope.type != "llama3")
        return inv;
    const double old_len = static_cast<double>(rope.original_max_positions);
    const double low_wavelen = old_len / rope.low_freq_factor;
    const double high_wavelen = old_len / rope.high_freq_factor;
    at::Tensor wavelen = inv.reciprocal() * (2.0 * M_PI);
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / rope.factor, inv);
    at::Tensor smooth = (wavelen.reciprocal() * old_len - rope.low_freq_factor) /
                        (rope.high_freq_factor - rope.low_freq_factor);
    at::Tensor smoothed = (1.0 - smooth) * scaled / rope.factor + smooth * scaled;
    at::Tensor medium =
        at::logical_not(wavelen < high_wavelen) * at::logical_not(wavelen > low_wavelen);
    return at::where(medium, smoothed, scaled);
}

class TokenEmbedding final : public Layer {
  public:
    TokenEmbedding(int64_t num, int64_t dim, double init_std) : num_(num) {
        params_.push_back(normal_param("weight", {num, dim}, init_std));
    }
    std::string type() const override { return "token_embedding"; }
    int64_t input_index_limit() const override { return vocab(); }
    int64_t vocab() const { return num_; }
    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &ids,
                       const LayerContext &) const override {
        TORCH_CHECK_VALUE(!at::isFloatingType(ids.scalar_type()),
                          "token_embedding needs integer token ids, got ",
                          c10::toString(ids.scalar_type()));
        return at::embedding(p[0], ids);
    }
    double cost_estimate() const override { return 1024.0; } // a gather, not a matmul
    // Its backward keeps only the token ids (int64).
    double activation_bytes_per_token(double) const override { return 8.0; }

  private:
    int64_t num_;
};

class DecoderLayer final : public Layer {
  public:
    explicit DecoderLayer(const DecoderSpec &s)
        : s_(s), inv_freq_(inverse_frequencies(s.rope, s.head_dim)) {
        const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
        auto add = [this](ParamSpec p) {
            params_.push_back(std::move(p));
            return static_cast<int>(params_.size() - 1);
        };
        auto bias = [&](bool on, const std::string &name, int64_t n) {
            return on ? add({name, {n}, InitKind::Zeros, 0.0}) : -1;
        };
        // A projection: its weight, its bias, then its adapter (PEFT's order inside the module).
        auto projection = [&](LoraTarget t, int64_t out, int64_t in, bool with_bias, int &w,
                              int &b) {
            const std::string path = lora_module_path(t);
            w = add(normal_param(path + ".weight", {out, in}, s.init_std));
            b = bias(with_bias, path + ".bias", out);
            if (s.lora.enabled() && s.lora.targets_projection(t)) {
                lora_a_[static_cast<int>(t)] = add(lora_a_param(t, s.lora.rank, in));
                lora_b_[static_cast<int>(t)] = add(lora_b_param(t, s.lora.rank, out));
            }
        };
        // Hugging Face's module order, so the parameters list like a state dict.
        projection(LoraTarget::Q, q, s.dim, s.attention_bias, q_w_, q_b_);
        projection(LoraTarget::K, kv, s.dim, s.attention_bias, k_w_, k_b_);
        projection(LoraTarget::V, kv, s.dim, s.attention_bias, v_w_, v_b_);
        projection(LoraTarget::O, s.dim, q, s.attention_bias, o_w_, o_b_);
        if (s.qk_norm) {
            q_norm_ = add({"self_attn.q_norm.weight", {s.head_dim}, InitKind::Ones, 0.0});
            k_norm_ = add({"self_attn.k_norm.weight", {s.head_dim}, InitKind::Ones, 0.0});
        }
        projection(LoraTarget::Gate, s.hidden, s.dim, s.mlp_bias, gate_w_, gate_b_);
        projection(LoraTarget::Up, s.hidden, s.dim, s.mlp_bias, up_w_, up_b_);
        projection(LoraTarget::Down, s.dim, s.hidden, s.mlp_bias, down_w_, down_b_);
        in_norm_ = add({"input_layernorm.weight", {s.dim}, InitKind::Ones, 0.0});
        post_norm_ = add({"post_attention_layernorm.weight", {s.dim}, InitKind::Ones, 0.0});
        if (s.lora.enabled()) // only the adapters train
            for (ParamSpec &spec : params_)
                if (spec.name.find(".lora_") == std::string::npos)
                    spec.role = ParamRole::Frozen;
    }

    std::string type() const override { return "decoder_layer"; }

    // What autograd keeps of forward() below per token on the fused path (every float, bf16 and
    // fp16 model), with d = dim, q = heads * head_dim, kv = kv_heads * head_dim, h = hidden,
    // e = dtype_bytes and f = 4 (fp32), from the save_for_backward lists of src/kernels:
    //  - the input RMSNorm keeps its input and its fp32 rstd per row, and its output is kept by
    //    the q/k/v projections: 2e d + f; the post-attention add_rms_norm keeps the residual sum
    //    and rstd, its output kept by the gate and up projections: 2e d + f;
    //  - queries with qk_norm: RoPE keeps the projection's output (for the norm's backward) and
    //    an fp32 rstd per head, attention keeps the rotated queries: 2e q + f heads; without
    //    qk_norm only the rotated ones: e q. Keys the same with kv and kv_heads; values e kv;
    //  - the RoPE half tables cos and sin: e head_dim;
    //  - attention's output (o_proj's input is a view of it) e q, and its fp32 logsumexp f heads;
    //  - the MLP: gate and up (kept by SwiGLU, which recomputes silu) and SwiGLU's output (kept
    //    by down_proj): 3e h.
    // Qwen3-1.7B in bf16: 72,104 bytes, 4.4 GiB per layer for 65,536 tokens. The unfused path
    // (other dtypes) keeps more (fp32 norm copies, silu's output: 113,216 bytes for the same
    // shape), and with an attention mask the keys and values are repeated to every head and a
    // [seq, seq] mask is made, which this per-token figure does not count.
    double activation_bytes_per_token(double e) const override {
        const double f = 4.0, d = static_cast<double>(s_.dim);
        const double q = static_cast<double>(s_.heads * s_.head_dim);
        const double kv = static_cast<double>(s_.kv_heads * s_.head_dim);
        const double heads = static_cast<double>(s_.heads),
                     kv_heads = static_cast<double>(s_.kv_heads);
        const double projected =
            s_.qk_norm ? 2.0 * e * (q + kv) + f * (heads + kv_heads) : e * (q + kv);
        return 2.0 * (2.0 * e * d + f) + projected + e * kv + e * static_cast<double>(s_.head_dim) +
               e * q + f * heads + 3.0 * e * static_cast<double>(s_.hidden) + adapter_bytes(e);
    }

    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &ctx) const override {
        TORCH_CHECK_VALUE(x.dim() == 3 && x.size(2) == s_.dim,
                          "decoder_layer needs hidden states [batch, seq, ", s_.dim, "], got ",
                          x.sizes());
        const int64_t b = x.size(0), t = x.size(1);
        const std::vector<at::Tensor> none;
        const std::vector<at::Tensor> &side = ctx.side_inputs ? *ctx.side_inputs : none;
        at::Tensor mask = side.size() > 0 ? side[0] : at::Tensor();
        at::Tensor positions = side.size() > 1 ? side[1] : at::Tensor();

        // The fused kernels on every device (CUDA on GPUs, their ATen twins on CPUs): in fp32
        // they equal the unfused expressions to rounding; in bf16/fp16 the RMSNorms keep
        // Hugging Face's rounding points and RoPE and SwiGLU round once where the expressions
        // round each product (src/kernels/*.cu say where).
        const bool fused = fusable(x, p);
        at::Tensor h =
            fused ? kernels::rms_norm(x, p[in_norm_], s_.eps) : rms_norm(x, p[in_norm_], s_.eps);
        at::Tensor q = project(h, p, LoraTarget::Q, q_w_, q_b_, ctx).view({b, t, s_.heads, s_.head_dim});
        at::Tensor k = project(h, p, LoraTarget::K, k_w_, k_b_, ctx).view({b, t, s_.kv_heads, s_.head_dim});
        at::Tensor v = project(h, p, LoraTarget::V, v_w_, v_b_, ctx).view({b, t, s_.kv_heads, s_.head_dim});

        at::Tensor cos, sin;
        rotary(positions, b, t, x, cos, sin);
        if (fused) {
            // q_norm/k_norm and the rotation in one pass over each head, before the transpose.
            const at::Tensor none;
            q = kernels::rope(q, cos, sin, s_.qk_norm ? p[q_norm_] : none, s_.eps);
            k = kernels::rope(k, cos, sin, s_.qk_norm ? p[k_norm_] : none, s_.eps);
            q = q.transpose(1, 2);
            k = k.transpose(1, 2);
        } else {
            if (s_.qk_norm) {
                q = rms_norm(q, p[q_norm_], s_.eps);
                k = rms_norm(k, p[k_norm_], s_.eps);
            }
            q = q.transpose(1, 2);
            k = k.transpose(1, 2);
            // Hugging Face's tables repeat the half tables: [batch or 1, 1, seq, head_dim].
            at::Tensor cos_full = at::cat({cos, cos}, -1).unsqueeze(1);
            at::Tensor sin_full = at::cat({sin, sin}, -1).unsqueeze(1);
            q = q * cos_full + rotate_half(q) * sin_full;
            k = k * cos_full + rotate_half(k) * sin_full;
        }
        v = v.transpose(1, 2);

        at::Tensor attn;
        if (mask.defined()) {
            k = repeat_kv(k);
            v = repeat_kv(v);
            TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == b && mask.size(1) == t,
                              "decoder_layer: the attention mask (input 1) must be [batch, seq] = "
                              "[",
                              b, ", ", t, "], got ", mask.sizes());
            at::Tensor keep = mask.ne(0).view({b, 1, 1, t});
            at::Tensor causal = at::ones({t, t}, x.options().dtype(at::kBool)).tril_();
            // A query always sees itself: a row that padding would empty entirely (left
            // padding) stays finite, and rows with any visible key are unchanged by it.
            at::Tensor self = at::eye(t, x.options().dtype(at::kBool));
            at::Tensor allowed = at::logical_or(at::logical_and(causal, keep), self);
            attn = at::scaled_dot_product_attention(q, k, v, allowed);
        } else {
            // Grouped-query attention inside the kernel: K and V are never copied per head.
            attn = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true,
                                                    std::nullopt, /*enable_gqa=*/true);
        }
        attn = attn.transpose(1, 2).reshape({b, t, s_.heads * s_.head_dim});
        at::Tensor attn_out = project(attn, p, LoraTarget::O, o_w_, o_b_, ctx);
        at::Tensor out, h2;
        if (fused) {
            std::tie(out, h2) = kernels::add_rms_norm(x, attn_out, p[post_norm_], s_.eps);
        } else {
            out = x + attn_out;
            h2 = rms_norm(out, p[post_norm_], s_.eps);
        }
        at::Tensor gate = project(h2, p, LoraTarget::Gate, gate_w_, gate_b_, ctx), up = project(h2, p, LoraTarget::Up, up_w_, up_b_, ctx);
        at::Tensor mlp = fused ? kernels::swiglu(gate, up) : at::silu(gate) * up;
        return out + project(mlp, p, LoraTarget::Down, down_w_, down_b_, ctx);
    }

  private:
    // A projection, plus its adapter's term where it has one.
    at::Tensor project(const at::Tensor &x, const std::vector<at::Tensor> &p, LoraTarget t, int w,
                       int b, const LayerContext &ctx) const {
        at::Tensor y = linear(x, p, w, b);
        const int a_index = lora_a_[static_cast<int>(t)];
        if (a_index < 0)
            return y;
        return y + lora_delta(x, p[a_index], p[lora_b_[static_cast<int>(t)]], s_.lora, t, ctx);
    }

    // What the adapters keep per token: A's output (r wide, kept by B) and, with dropout, the
    // dropped input and its mask (A's input).
    double adapter_bytes(double e) const {
        double bytes = 0;
        const double r = static_cast<double>(s_.lora.rank);
        const double d = static_cast<double>(s_.dim), h = static_cast<double>(s_.hidden),
                     q = static_cast<double>(s_.heads * s_.head_dim);
        const double in[kLoraTargets] = {d, d, d, q, d, d, h};
        for (int t = 0; t < kLoraTargets; ++t)
            if (lora_a_[t] >= 0)
                bytes += e * r + (s_.lora.dropout > 0 ? 2.0 * e * in[t] : 0.0);
        return bytes;
    }

    // The fused kernels cover float32, bfloat16 and float16 with the norm weights in the
    // activations' dtype; other models (float64, weights kept in another dtype) run the
    // unfused expressions.
    bool fusable(const at::Tensor &x, const std::vector<at::Tensor> &p) const {
        const at::ScalarType dt = x.scalar_type();
        if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf)
            return false;
        for (int i : {in_norm_, post_norm_, q_norm_, k_norm_})
            if (i >= 0 && p[i].scalar_type() != dt)
                return false;
        return true;
    }

    // cos and sin [batch or 1, seq, head_dim / 2] in x's dtype, as transformers'
    // LlamaRotaryEmbedding computes them (angles in fp32, then rounded); its tables repeat
    // these along the last dimension.
    void rotary(const at::Tensor &positions, int64_t b, int64_t t, const at::Tensor &x,
                at::Tensor &cos, at::Tensor &sin) const {
        at::Tensor pos;
        if (positions.defined()) {
            TORCH_CHECK_VALUE(!at::isFloatingType(positions.scalar_type()),
                              "decoder_layer: position ids (input 2) must be integers");
            TORCH_CHECK_VALUE(positions.dim() == 2 &&
                                  (positions.size(0) == b || positions.size(0) == 1) &&
                                  positions.size(1) == t,
                              "decoder_layer: position ids (input 2) must be [batch, seq] = [", b,
                              ", ", t, "] or [1, ", t, "], got ", positions.sizes());
            pos = positions;
        } else {
            pos = at::arange(t, x.options().dtype(at::kLong)).unsqueeze(0);
        }
        at::Tensor inv = inv_freq_.to(x.device(), /*non_blocking=*/true);
        at::Tensor freqs = pos.unsqueeze(-1).to(at::kFloat) * inv;
        cos = freqs.cos().to(x.scalar_type());
        sin = freqs.sin().to(x.scalar_type());
    }

    at::Tensor repeat_kv(const at::Tensor &x) const {
        const int64_t rep = s_.heads / s_.kv_heads;
        if (rep == 1)
            return x;
        const int64_t b = x.size(0), t = x.size(2);
        return x.unsqueeze(2)
            .expand({b, s_.kv_heads, rep, t, s_.head_dim})
            .reshape({b, s_.heads, t, s_.head_dim});
    }

    DecoderSpec s_;
    at::Tensor inv_freq_; // fp32 CPU constant, never trained
    int q_w_, q_b_, k_w_, k_b_, v_w_, v_b_, o_w_, o_b_;
    int q_norm_ = -1, k_norm_ = -1;
    int gate_w_, gate_b_, up_w_, up_b_, down_w_, down_b_;
    int in_norm_, post_norm_;
    int lora_a_[kLoraTargets] = {-1, -1, -1, -1, -1, -1, -1};
    int lora_b_[kLoraTargets] = {-1, -1, -1, -1, -1, -1, -1};
};

} // namespace

std::unique_ptr<Layer> make_token_embedding(int64_t num, int64_t dim, double init_std) {
    return std::make_unique<TokenEmbedding>(num, dim, init_std);
}

std::unique_ptr<Layer> make_decoder_layer(const DecoderSpec &spec) {
    return std::make_unique<DecoderLayer>(spec);
}

} // namespace rp
