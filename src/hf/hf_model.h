// A Hugging Face causal LM as a RoundPipe model: the layers its config describes, the Hugging
// Face name of each parameter, and weights moved between the model and a checkpoint directory.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/model.h"
#include "hf/hf_checkpoint.h"
#include "hf/hf_config.h"

namespace rp {

// A projection weight with a LoRA adapter: indices in the parameter store.
struct LoraPair {
    size_t base, a, b;
};

// A tensor of the model's Hugging Face checkpoints: the parameter (index in the parameter store)
// it is part of, and where.
struct HfCheckpointTensor {
    size_t param;
    HfStoredTensor stored;
};

// What a model built from a Hugging Face config keeps for saving it back.
struct HfModelInfo {
    HfModelConfig config;
    HfLayout layout; // of the checkpoint last loaded (single file when none was)
    // Hugging Face name of each parameter, store order; an adapter's is its PEFT name without
    // PEFT's "base_model.model." prefix ("model.layers.0.self_attn.q_proj.lora_A.weight").
    std::vector<std::string> tensor_names;
    LoraSpec lora;                      // rank 0: no adapters
    std::vector<size_t> base_params;    // the parameters a Hugging Face checkpoint holds
    std::vector<HfCheckpointTensor> checkpoint_tensors; // theirs, in checkpoint order
    std::vector<size_t> adapter_params; // the LoRA adapters' (A, B of each projection)
    std::vector<LoraPair> lora_pairs;
};

struct HfModel {
    std::unique_ptr<Model> model;
    std::unique_ptr<HfModelInfo> info;
};

// Builds the model `config` describes. With `dir`, its checkpoint is opened and every tensor
// validated before the model (and its memory) exists, then installed, reported as the operation
// "load <dir>" in checkpoint bytes; without, weights are initialised from the seed as
// transformers does.
// With `lora` enabled, the decoder layers carry adapters (src/layers/lora.h) and every other
// parameter is frozen.
HfModel create_hf_model(const HfModelConfig &config, const ModelOptions &options,
                        const LoraSpec &lora, const std::string *dir);

// Replaces every weight by the checkpoint in `dir` (all validated first: on error nothing
// changes); accumulated gradients are dropped. Later saves use that checkpoint's layout. Reported
// as the operation "load <dir>".
void load_hf_weights(Model &model, HfModelInfo &info, const std::string &dir);

// Writes the latest weights (synchronizes first) and config.json into `dir`. A LoRA model
// writes its merged weights (W + (alpha / r) B A, rounded once to the model dtype): a plain
// Hugging Face model.
void save_hf_model(Model &model, const HfModelInfo &info, const std::string &dir);

} // namespace rp
