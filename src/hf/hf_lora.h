// LoRA adapters of a Hugging Face model in PEFT's format: a directory with adapter_config.json
// (PEFT's LoraConfig) and adapter_model.safetensors, whose tensors are named
// "base_model.model.<Hugging Face module>.lora_A.weight" / ".lora_B.weight" as
// PeftModel.save_pretrained writes them and PeftModel.from_pretrained reads them.
#pragma once
#include <string>

#include "hf/hf_model.h"

namespace rp {

// Writes the adapters' latest fp32 master weights (synchronizes first) and their configuration
// into `dir` (created if missing, one level). Each file is replaced crash-safely, the weights
// first. `base_model` goes to adapter_config.json's base_model_name_or_path (empty: null).
void save_lora_adapter(Model &model, const HfModelInfo &info, const std::string &dir,
                       const std::string &base_model);

// Reads adapters saved by save_lora_adapter or by PEFT into the model's adapters. Everything is
// checked before any weight changes: adapter_config.json must describe this model's LoRA (PEFT
// type, rank, alpha, target modules; dropout may differ, it only acts in training), and the file
// must hold exactly the model's adapter tensors with their shapes (the message names the tensor).
// Synchronizes first; optimizer state is kept, accumulated gradients are dropped.
void load_lora_adapter(Model &model, const HfModelInfo &info, const std::string &dir);

} // namespace rp
