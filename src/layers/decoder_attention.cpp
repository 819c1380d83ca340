#include "layers/decoder_attention.h"

#include <cmath>
#include <tuple>

#include "kernels/rms_norm.h"
#include "kernels/rope.h"

namespace rp {
namespace {

// Hugging Face's LlamaRMSNorm / Qwen3RMSNorm: normalise in fp32, round to the input dtype, then
// scale. This and the other unfused expressions below serve the dtypes the fused kernels
// (src/kernels/) have no code for; tests/kernels checks the kernels against them.
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    at::Tensor xf = x.to(at::kFloat);
    at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
    return weight * normed.to(x.scalar_type());
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

} // namespace

DecoderAttention::DecoderAttention(const DecoderSpec &spec, std::string layer)
    : s_(spec), layer_(std::move(layer)), inv_freq_(inverse_frequencies(spec.rope, spec.head_dim)) {
}

void DecoderAttention::declare_projections(std::vector<ParamSpec> &params) {
    const int64_t q = s_.heads * s_.head_dim, kv = s_.kv_heads * s_.head_dim;
    const bool bias = s_.attention_bias;
    q_ = Projection(params, LoraTarget::Q, q, s_.dim, bias, s_.init_std, s_.lora);
    k_ = Projection(params, LoraTarget::K, kv, s_.dim, bias, s_.init_std, s_.lora);
    v_ = Projection(params, LoraTarget::V, kv, s_.dim, bias, s_.init_std, s_.lora);
    o_ = Projection(params, LoraTarget::O, s_.dim, q, bias, s_.init_std, s_.lora);
    if (s_.qk_norm) {
        params.push_back({"self_attn.q_norm.weight", {s_.head_dim}, InitKind::Ones, 0.0});
        q_norm_ = static_cast<int>(params.size() - 1);
        params.push_back({"self_attn.k_norm.weight", {s_.head_dim}, InitKind::Ones, 0.0});
        k_norm_ = static_cast<int>(params.size() - 1);
    }
}

void DecoderAttention::declare_norms(std::vector<ParamSpec> &params) {
    params.push_back({"input_layernorm.weight", {s_.dim}, InitKind::Ones, 0.0});
    in_norm_ = static_cast<int>(params.size() - 1);
    params.push_back({"post_attention_layernorm.weight", {s_.dim}, InitKind::Ones, 0.0});
    post_norm_ = static_cast<int>(params.size() - 1);
}

// The terms, with d = dim, q = heads * head_dim, kv = kv_heads * head_dim, e = dtype_bytes and
// f = 4 (fp32), from the save_for_backward lists of src/kernels:
//  - the input RMSNorm keeps its input and its fp32 rstd per row, and its output is kept by the
//    q/k/v projections: 2e d + f; the post-attention add_rms_norm keeps the residual sum and
//    rstd, its output kept by the MLP's first projections: 2e d + f;
//  - queries with qk_norm: RoPE keeps the projection's output (for the norm's backward) and an
//    fp32 rstd per head, attention keeps the rotated queries: 2e q + f heads; without qk_norm
//    only the rotated ones: e q. Keys the same with kv and kv_heads; values e kv;
//  - the RoPE half tables cos and sin: e head_dim;
//  - attention's output (o_proj's input is a view of it) e q, and its fp32 logsumexp f heads.
double DecoderAttention::activation_bytes_per_token(double e) const {
    const double f = 4.0, d = static_cast<double>(s_.dim);
    const double q = static_cast<double>(s_.heads * s_.head_dim);
    const double kv = static_cast<double>(s_.kv_heads * s_.head_dim);
    const double heads = static_cast<double>(s_.heads), kv_heads = static_cast<double>(s_.kv_heads);
    const double projected =
        s_.qk_norm ? 2.0 * e * (q + kv) + f * (heads + kv_heads) : e * (q + kv);
    double adapters = 0;
    for (const Projection *p : {&q_, &k_, &v_, &o_})
        adapters += p->adapter_bytes(e, s_.lora);
    return 2.0 * (2.0 * e * d + f) + projected + e * kv + e * static_cast<double>(s_.head_dim) +
           e * q + f * heads + adapters;
}

DecoderAttention::Output DecoderAttention::forward(const std::vector<at::Tensor> &p,
                                                   const at::Tensor &x,
                                                   const LayerContext &ctx) const {
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(2) == s_.dim, layer_,
                      " needs hidden states [batch, seq, ", s_.dim, "], got ", x.sizes());
    const int64_t b = x.size(0), t = x.size(1);
    const std::vector<at::Tensor> none;
    const std::vector<at::Tensor> &side = ctx.side_inputs ? *ctx.side_inputs : none;
    at::Tensor mask = side.size() > 0 ? side[0] : at::Tensor();
    at::Tensor positions = side.size() > 1 ? side[1] : at::Tensor();

    // The fused kernels on every device (CUDA on GPUs, their ATen twins on CPUs): in fp32 they
    // equal the unfused expressions to rounding; in bf16/fp16 the RMSNorms keep Hugging Face's
    // rounding points and RoPE rounds once where the expressions round each product
    // (src/kernels/*.cu say where).
    const bool fused = fusable(x, p);
    at::Tensor h =
        fused ? kernels::rms_norm(x, p[in_norm_], s_.eps) : rms_norm(x, p[in_norm_], s_.eps);
    at::Tensor q = q_(h, p, s_.lora, ctx).view({b, t, s_.heads, s_.head_dim});
    at::Tensor k = k_(h, p, s_.lora, ctx).view({b, t, s_.kv_heads, s_.head_dim});
    at::Tensor v = v_(h, p, s_.lora, ctx).view({b, t, s_.kv_heads, s_.head_dim});

    at::Tensor cos, sin;
    rotary(positions, b, t, x, cos, sin);
    if (fused) {
        // q_norm/k_norm and the rotation in one pass over each head, before the transpose.
        const at::Tensor no_norm;
        q = kernels::rope(q, cos, sin, s_.qk_norm ? p[q_norm_] : no_norm, s_.eps);
        k = kernels::rope(k, cos, sin, s_.qk_norm ? p[k_norm_] : no_norm, s_.eps);
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
        TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == b && mask.size(1) == t, layer_,
                          ": the attention mask (input 1) must be [batch, seq] = [", b, ", ", t,
                          "], got ", mask.sizes());
        at::Tensor keep = mask.ne(0).view({b, 1, 1, t});
        at::Tensor causal = at::ones({t, t}, x.options().dtype(at::kBool)).tril_();
        // A query always sees itself: a row that padding would empty entirely (left padding)
        // stays finite, and rows with any visible key are unchanged by it.
        at::Tensor self = at::eye(t, x.options().dtype(at::kBool));
        at::Tensor allowed = at::logical_or(at::logical_and(causal, keep), self);
        attn = at::scaled_dot_product_attention(q, k, v, allowed);
    } else {
        // Grouped-query attention inside the kernel: K and V are never copied per head.
        attn = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                                /*enable_gqa=*/true);
    }
    attn = attn.transpose(1, 2).reshape({b, t, s_.heads * s_.head_dim});
    at::Tensor attn_out = o_(attn, p, s_.lora, ctx);
    Output out;
    if (fused) {
        std::tie(out.residual, out.normed) =
            kernels::add_rms_norm(x, attn_out, p[post_norm_], s_.eps);
    } else {
        out.residual = x + attn_out;
        out.normed = rms_norm(out.residual, p[post_norm_], s_.eps);
    }
    return out;
}

bool DecoderAttention::fusable(const at::Tensor &x, const std::vector<at::Tensor> &p) const {
    const at::ScalarType dt = x.scalar_type();
    if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf)
        return false;
    for (int i : {in_norm_, post_norm_, q_norm_, k_norm_})
        if (i >= 0 && p[i].scalar_type() != dt)
            return false;
    return true;
}

// cos and sin [batch or 1, seq, head_dim / 2] in x's dtype, as transformers'
// LlamaRotaryEmbedding computes them (angles in fp32, then rounded); its tables repeat these
// along the last dimension.
void DecoderAttention::rotary(const at::Tensor &positions, int64_t b, int64_t t,
                              const at::Tensor &x, at::Tensor &cos, at::Tensor &sin) const {
    at::Tensor pos;
    if (positions.defined()) {
        TORCH_CHECK_VALUE(!at::isFloatingType(positions.scalar_type()), layer_,
                          ": position ids (input 2) must be integers");
        TORCH_CHECK_VALUE(positions.dim() == 2 &&
                              (positions.size(0) == b || positions.size(0) == 1) &&
                              positions.size(1) == t,
                          layer_, ": position ids (input 2) must be [batch, seq] = [", b, ", ", t,
                          "] or [1, ", t, "], got ", positions.sizes());
        pos = positions;
    } else {
        pos = at::arange(t, x.options().dtype(at::kLong)).unsqueeze(0);
    }
    at::Tensor inv = inv_freq_.to(x.device(), /*non_blocking=*/true);
    at::Tensor freqs = pos.unsqueeze(-1).to(at::kFloat) * inv;
    cos = freqs.cos().to(x.scalar_type());
    sin = freqs.sin().to(x.scalar_type());
}

at::Tensor DecoderAttention::repeat_kv(const at::Tensor &x) const {
    const int64_t rep = s_.heads / s_.kv_heads;
    if (rep == 1)
        return x;
    const int64_t b = x.size(0), t = x.size(2);
    return x.unsqueeze(2)
        .expand({b, s_.kv_heads, rep, t, s_.head_dim})
        .reshape({b, s_.heads, t, s_.head_dim});
}

} // namespace rp
