// Layers of decoder-only transformers of the Llama, Qwen3 and Qwen3-MoE families: token
// embedding, decoder layer (pre-norm attention with RoPE and grouped-query heads, SwiGLU MLP),
// mixture-of-experts decoder layer (the same attention, then routed SwiGLU experts) and the LM
// head that fuses the causal-LM loss. docs/semantics.md states what each computes.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/layer.h"
#include "layers/lora.h"

namespace rp {

// Label value that marks a token without a target (Hugging Face's ignore_index).
constexpr int64_t kIgnoreIndex = kIgnoreLabel;

// Rotary position embedding: the inverse frequencies of Hugging Face's "default", "linear" and
// "llama3" rope types.
struct RopeSpec {
    double theta = 10000.0;
    std::string type = "default";
    double factor = 1.0;                   // linear, llama3
    double low_freq_factor = 1.0;          // llama3
    double high_freq_factor = 4.0;         // llama3
    int64_t original_max_positions = 8192; // llama3
};

// Largest head dimension a decoder layer accepts: each layer builds a rotary table of
// head_dim / 2 floats when it is constructed, before any size check could refuse the model.
constexpr int64_t kMaxHeadDim = 65536;

struct DecoderSpec {
    int64_t dim = 0;
    int64_t heads = 0;
    int64_t kv_heads = 0;
    int64_t head_dim = 0;
    int64_t hidden = 0; // MLP intermediate size
    double eps = 1e-6;
    RopeSpec rope;
    bool qk_norm = false; // Qwen3: RMSNorm over each query and key head
    bool attention_bias = false;
    bool mlp_bias = false;
    double init_std = 0.02;
    // Adapters on the projections (src/layers/lora.h). With them every other parameter of the
    // layer is frozen: held once in the model dtype, no master, gradient or optimizer state.
    LoraSpec lora;
};

// A parameter drawn from normal(0, std). normal(0, 0) is zeros, and zero-filling is a memset where
// drawing is a serial generator: models whose weights come from a checkpoint are built with
// init_std 0 so creation stays fast.
ParamSpec normal_param(const std::string &name, std::vector<int64_t> shape, double std);

// Rows of `weight` [num, dim] at the token ids (input 0): normal(0, init_std) initialisation.
std::unique_ptr<Layer> make_token_embedding(int64_t num, int64_t dim, double init_std);

// One decoder layer. Side inputs: [0] attention mask [batch, seq] (non-zero: attend), [1]
// position ids [batch, seq] or [1, seq]; both optional.
std::unique_ptr<Layer> make_decoder_layer(const DecoderSpec &spec);

// The sparse MLP of a mixture-of-experts decoder layer (Qwen3-MoE): a router over `experts`
// SwiGLU experts of width `expert_hidden`, of which each token uses its `top_k` most probable.
struct MoeSpec {
    int64_t experts = 0;
    int64_t top_k = 0;
    int64_t expert_hidden = 0;   // moe_intermediate_size
    bool norm_topk_prob = false; // renormalise the top-k probabilities to sum to 1
};

// A decoder layer whose MLP is `moe`'s (src/layers/moe_decoder_layer.cpp); the attention half is
// the decoder layer's, adapters included. `spec.hidden` and `spec.mlp_bias` are unused (the
// experts have no biases); LoRA adapters exist on the attention projections only.
std::unique_ptr<Layer> make_moe_decoder_layer(const DecoderSpec &spec, const MoeSpec &moe);

// Projection to the vocabulary (src/layers/lm_head.cpp). With integer labels in its context (training, fused tail stage)
// it returns the sum of the shifted token cross entropies of the microbatch as a 0-d fp32
// tensor, computed `chunk_tokens` tokens at a time (0: automatic) so the logits of the whole
// microbatch never exist; otherwise it returns the logits. `tied_to` names an earlier layer's
// parameter ("0.weight") to share, or is empty.
std::unique_ptr<Layer> make_lm_head(int64_t dim, int64_t vocab, const std::string &tied_to,
                                    double init_std, int64_t chunk_tokens);

} // namespace rp
