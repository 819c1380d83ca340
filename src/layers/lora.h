// LoRA adapters (Hu et al. 2021, as PEFT's LoraConfig defines them) on the linear projections
// of a decoder layer: y = x W^T + b + (alpha / r) * B (A dropout(x)), with A [r, in] and B
// [out, r] trainable and W, b frozen. PEFT initialises A with kaiming_uniform(a = sqrt(5)),
// that is uniform(-1/sqrt(in), 1/sqrt(in)), and B with zeros, so a fresh adapter changes nothing.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "engine/layer.h"

namespace rp {

// The projections of a decoder layer that can carry an adapter, by PEFT's module names.
enum class LoraTarget { Q, K, V, O, Gate, Up, Down };
constexpr int kLoraTargets = 7;
// The attention projections q, k, v, o: the only targets of a mixture-of-experts layer.
constexpr unsigned kLoraAttentionTargets = (1u << (static_cast<int>(LoraTarget::O) + 1)) - 1;

struct LoraSpec {
    int64_t rank = 0; // 0: no adapters
    double alpha = 0.0;
    double dropout = 0.0;
    unsigned targets = 0; // bit (1 << LoraTarget) per adapted projection

    bool enabled() const { return rank > 0; }
    bool targets_projection(LoraTarget t) const { return targets & (1u << static_cast<int>(t)); }
    double scaling() const { return alpha / static_cast<double>(rank); }
};

// PEFT's module name of a target ("q_proj") and its path inside a decoder layer
// ("self_attn.q_proj").
const char *lora_target_name(LoraTarget t);
std::string lora_module_path(LoraTarget t);

// Parses PEFT's target_modules: comma-separated module names, or "all-linear" (every projection
// of the decoder layer); NULL or empty: PEFT's default for Llama and Qwen3, q_proj and v_proj.
// An unknown name is refused by name (InvalidArgument), listing the names that exist.
unsigned parse_lora_targets(const char *text);
// The targets as PEFT lists them, in the decoder layer's order.
std::vector<std::string> lora_target_names(unsigned targets);
std::string lora_targets_text(unsigned targets); // comma-separated

// Checks a LoRA configuration from a caller (rank > 0 and <= 65536, alpha finite and > 0,
// dropout in [0, 1)); InvalidArgument naming the bad value.
void check_lora_spec(const LoraSpec &spec);

// The two adapter parameters of a projection with input width `in` and output width `out`,
// named "<path>.lora_A.weight" and "<path>.lora_B.weight".
ParamSpec lora_a_param(LoraTarget t, int64_t rank, int64_t in);
ParamSpec lora_b_param(LoraTarget t, int64_t rank, int64_t out);
// Whether a parameter's name (a layer's own, or any name ending in it) is an adapter's.
bool is_lora_adapter(const std::string &param_name);

// The adapter's term (alpha / r) * B (A dropout(x)), in x's dtype. Dropout masks come from a
// generator seeded by (ctx.dropout_seed, target), on x's device: the recompute of a backward
// pass replays the forward's masks exactly.
at::Tensor lora_delta(const at::Tensor &x, const at::Tensor &a, const at::Tensor &b,
                      const LoraSpec &spec, LoraTarget t, const LayerContext &ctx);

} // namespace rp
