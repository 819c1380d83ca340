// The model shapes train_bench trains (public config.json of each Qwen3 model; `tiny` for CPU
// smoke runs), their parameter and FLOP counts, and the Hugging Face config given to the engine.
#pragma once

#include <cstdint>
#include <string>

namespace tb {

struct Shape {
    std::string name;
    int64_t hidden, layers, heads, kv_heads, head_dim, intermediate, vocab;
    bool tied;
    // Defaults used when --batch/--seq/--microbatches are not given.
    int64_t batch, seq, microbatches;
    // Qwen3-MoE shapes: every decoder layer sparse, `experts` SwiGLU experts of width
    // `moe_intermediate`, `top_k` of them per token (0 experts: a dense Qwen3).
    int64_t experts = 0, top_k = 0, moe_intermediate = 0;
    bool moe() const { return experts > 0; }
};

// The shape called `name`, or nullptr.
const Shape *find_shape(const std::string &name);

// "tiny|qwen3-0.6b|..." for the usage text.
std::string shape_names();

// Every parameter with a master weight of its own (the tied LM head counts once).
int64_t total_params(const Shape &s);

// Parameters that take part in a matrix multiply per token: all but the input embedding table,
// which is a gather, unless it is tied to the LM head (then it is the LM head's matmul); of a
// mixture of experts only the router and the top_k experts a token is sent to.
int64_t flop_params(const Shape &s);

// Parameters of LoRA adapters of `rank` on every projection of every decoder layer that
// `targets` names ("all-linear", or PEFT module names separated by commas): rank * (in + out)
// per adapted projection.
int64_t lora_params(const Shape &s, int rank, const std::string &targets);

// QK^T and AV of a causal sequence touch T^2/2 query-key pairs per head, 2 multiply-adds of
// head_dim each: forward 2 * T^2 * heads * head_dim flops per layer and sequence (backward is
// twice the forward, recompute once more).
double attention_forward_flops(const Shape &s, int64_t batch, int64_t seq);

// config.json of a Qwen3ForCausalLM (Qwen3MoeForCausalLM for MoE shapes) of this shape, for
// rp_model_create_from_hf_config.
std::string hf_config_json(const Shape &s);

} // namespace tb
