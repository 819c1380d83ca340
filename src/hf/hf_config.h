// Hugging Face config.json of the supported causal LMs (Qwen3ForCausalLM, LlamaForCausalLM): the
// validated configuration, and the names of our parameters in Hugging Face checkpoints.
//
// Layer list for a model with L decoder layers, and the Hugging Face prefix of each layer's
// parameters:
//   0          token_embedding   model.embed_tokens.
//   1 .. L     decoder_layer     model.layers.<i - 1>.
//   L + 1      rms_norm          model.norm.
//   L + 2      lm_head           lm_head.            (tied: shares "0.weight", not saved)
// A parameter "<layer>.<local name>" is "<prefix><local name>" in the checkpoint.
#pragma once
#include <cstdint>
#include <string>

#include <ATen/ATen.h>

#include "base/error.h"
#include "layers/transformer_layers.h" // RopeSpec

namespace rp {

struct HfModelConfig {
    std::string architecture; // "Qwen3ForCausalLM" or "LlamaForCausalLM"
    int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0;
    int64_t heads = 0, kv_heads = 0, head_dim = 0;
    double eps = 1e-6;
    double init_std = 0.02;
    RopeSpec rope;
    bool tied = false;
    bool qk_norm = false;
    bool attention_bias = false;
    bool mlp_bias = false;
    std::string json_text; // the config as given, written back on save
};

// Parses and validates a config.json text. `where` names it in messages (a path, or
// "config_json"); a malformed document fails with `parse_error` (Io for a file, InvalidArgument
// for text from the caller), an unsupported architecture or feature with InvalidArgument.
HfModelConfig parse_hf_config(const std::string &json_text, const std::string &where,
                              ErrorKind parse_error);

// Hugging Face tensor name of our parameter `name` ("3.mlp.up_proj.weight" ->
// "model.layers.2.mlp.up_proj.weight").
std::string hf_tensor_name(const HfModelConfig &config, const std::string &name);

// The config text to save beside weights of dtype `dtype`: the original document with its
// "dtype" (and legacy "torch_dtype") entry updated.
std::string hf_config_for_save(const HfModelConfig &config, at::ScalarType dtype);

} // namespace rp
