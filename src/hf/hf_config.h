// Hugging Face config.json of the supported causal LMs (Qwen3ForCausalLM, Qwen3MoeForCausalLM,
// LlamaForCausalLM): the validated configuration, and the names of our parameters in Hugging
// Face models and checkpoints.
//
// Layer list for a model with L decoder layers, and the Hugging Face prefix of each layer's
// parameters:
//   0          token_embedding   model.embed_tokens.
//   1 .. L     decoder_layer     model.layers.<i - 1>.
//              (moe_decoder_layer where sparse_layer(i - 1))
//   L + 1      rms_norm          model.norm.
//   L + 2      lm_head           lm_head.            (tied: shares "0.weight", not saved)
// A parameter "<layer>.<local name>" is "<prefix><local name>" in a transformers model's state
// dict, and in checkpoints except the stacked expert weights (hf_stored_tensors).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "base/error.h"
#include "layers/transformer_layers.h" // RopeSpec

namespace rp {

struct HfModelConfig {
    std::string architecture; // "Qwen3ForCausalLM", "Qwen3MoeForCausalLM" or "LlamaForCausalLM"
    int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0;
    int64_t heads = 0, kv_heads = 0, head_dim = 0;
    double eps = 1e-6;
    double init_std = 0.02;
    RopeSpec rope;
    bool tied = false;
    bool qk_norm = false;
    bool attention_bias = false;
    bool mlp_bias = false;
    // Qwen3MoeForCausalLM's sparse MLP (num_experts 0: every layer is dense).
    int64_t num_experts = 0, experts_per_token = 0, moe_intermediate = 0;
    bool norm_topk_prob = false;
    int64_t decoder_sparse_step = 1;
    std::vector<int64_t> mlp_only_layers;
    std::string json_text; // the config as given, written back on save

    // Whether decoder layer `i` (0-based) is a mixture-of-experts layer, as transformers'
    // Qwen3MoeDecoderLayer decides: not listed in mlp_only_layers, and every
    // decoder_sparse_step-th layer.
    bool sparse_layer(int64_t i) const;
    // How many decoder layers are sparse, counted without visiting each layer (a config may
    // declare any number of them before the host-memory check refuses it).
    int64_t sparse_layer_count() const;
};

// Parses and validates a config.json text. `where` names it in messages (a path, or
// "config_json"); a malformed document fails with `parse_error` (Io for a file, InvalidArgument
// for text from the caller), an unsupported architecture or feature with InvalidArgument.
HfModelConfig parse_hf_config(const std::string &json_text, const std::string &where,
                              ErrorKind parse_error);

// Hugging Face tensor name of our parameter `name` ("3.mlp.up_proj.weight" ->
// "model.layers.2.mlp.up_proj.weight").
std::string hf_tensor_name(const HfModelConfig &config, const std::string &name);

// A tensor of a Hugging Face checkpoint and where it sits in one of our parameters. Most
// parameters are stored whole under their Hugging Face name; the stacked expert weights of a
// mixture-of-experts layer ("model.layers.0.mlp.experts.gate_up_proj" [experts, 2 i, d] and
// ".down_proj" [experts, d, i], as transformers 5 holds them in memory) are stored one tensor per
// expert and projection, as transformers' save_pretrained writes them and Qwen3-MoE checkpoints
// hold them: "model.layers.0.mlp.experts.<e>.gate_proj.weight" [i, d] (rows 0 .. i of expert
// e's block), ".up_proj.weight" (rows i .. 2i), ".down_proj.weight" [d, i].
struct HfStoredTensor {
    std::string name;
    std::vector<int64_t> shape;
    int64_t expert = -1; // -1: the whole parameter; else its slice `expert` along dim 0,
    int64_t row = 0;     // from this row on (shape[0] rows)

    // The part of `param` (one of ours, full shape) this tensor holds: a view.
    at::Tensor part_of(const at::Tensor &param) const;
};

// The checkpoint tensors of the parameter with Hugging Face name `name` and shape `shape`.
std::vector<HfStoredTensor> hf_stored_tensors(const std::string &name,
                                              const std::vector<int64_t> &shape);

// The config text to save beside weights of dtype `dtype`: the original document with its
// "dtype" (and legacy "torch_dtype") entry updated.
std::string hf_config_for_save(const HfModelConfig &config, at::ScalarType dtype);

} // namespace rp
