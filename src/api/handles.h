// What the opaque handles of roundpipe.h hold.
#pragma once
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "api/roundpipe_internal.h"
#include "engine/loss.h"
#include "engine/model.h"
#include "engine/caller_call.h"
#include "engine/run_config.h"
#include "hf/hf_model.h"

struct rp_run_config {
    rp::RunConfig config;
};

struct rp_model_options {
    rp::ModelOptions options;
    rp::LoraSpec lora; // Hugging Face models only (rp_model_options_set_lora)
};

namespace rp {
// LoRA adapters exist on the decoder layers of Hugging Face models only: a model built from a
// spec refuses options that ask for them, naming its layer types.
inline void refuse_lora_options(const rp_model_options *options,
                                const std::vector<std::unique_ptr<Layer>> &layers) {
    if (!options || !options->lora.enabled())
        return;
    std::string types;
    for (const auto &layer : layers)
        if (types.find(layer->type()) == std::string::npos)
            types += (types.empty() ? "" : ", ") + layer->type();
    fail(ErrorKind::InvalidArgument,
         "LoRA adapters (rp_model_options_set_lora) exist only on the decoder layers of Hugging "
         "Face models (rp_model_create_from_hf, rp_model_create_from_hf_config); layer types " +
             types + " have none");
}
} // namespace rp

struct rp_model {
    std::unique_ptr<rp::Model> model;
    std::atomic<bool> busy{false}; // an exported call holds the model (api/model_call.h)
    std::string trace_json; // backs the pointer rp_model_trace_json hands out
    std::unique_ptr<rp::HfModelInfo> hf; // models built from a Hugging Face config only
    std::string lora_targets;            // backs the pointer rp_model_lora hands out
};

struct rp_loss {
    rp::LossKind kind = rp::LossKind::Output;
    double scale = 1.0;
    rp_loss_fn fn = nullptr;
    rp_device_loss_fn device_fn = nullptr;
    void *user_data = nullptr;
};

struct rp_layer_def {
    std::string type_name;
    rp_layer_forward_fn forward = nullptr;
    rp_layer_backward_fn backward = nullptr;
    rp_layer_release_fn release = nullptr;
    void *user_data = nullptr;
    std::vector<rp::ParamSpec> params; // parameters and buffers, in declaration order
    double cost = -1.0;                // < 0: the default estimate
    double activation_bytes = -1.0;    // per token; < 0: the default estimate
};

struct rp_optimizer {
    rp::OptimizerSettings settings;
};

struct rp_tensor_list {
    std::vector<at::Tensor> tensors; // undefined where NULL was pushed
    // The first rp_tensor_list_push that failed validation: the engine reports it when it reads
    // the list, so a callback that ignores the push status still fails with the reason.
    std::string push_error;
};

// What a callback invocation sees through rp_layer_call_info / rp_layer_call_tensors. The DLPack
// views of the parameters and buffers are made at the first request and die with the invocation.
struct rp_layer_call {
    const rp::CallerCall *call = nullptr;
    mutable std::vector<DLManagedTensor *> params, buffers;
    mutable bool exported = false;

    rp_layer_call() = default;
    rp_layer_call(const rp_layer_call &) = delete;
    rp_layer_call &operator=(const rp_layer_call &) = delete;
    ~rp_layer_call(); // api/caller_bridge.cpp
    void export_tensors() const;
};
