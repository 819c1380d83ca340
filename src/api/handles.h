// What the opaque handles of roundpipe.h hold.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "api/roundpipe_internal.h"
#include "engine/loss.h"
#include "engine/model.h"
#include "engine/run_config.h"
#include "io/hf_checkpoint.h"
#include "io/hf_config.h"
#include "layers/transformer_layers.h"
#include "optim/builtin_optimizer.h"

struct rp_run_config {
    rp::RunConfig config;
};

struct rp_model_options {
    rp::ModelOptions options;
};

// What a model built from a Hugging Face config keeps for saving it back.
struct rp_hf_info {
    rp::HfModelConfig config;
    rp::HfLayout layout; // of the checkpoint last loaded (single file when none was)
};

struct rp_model {
    std::unique_ptr<rp::Model> model;
    std::string trace_json; // backs the pointer rp_model_trace_json hands out
    // Vocabulary of a first token_embedding / last lm_head layer (0: none). Token ids and labels
    // are range-checked on the host against them, before a device could index out of bounds.
    int64_t input_vocab = 0;
    int64_t label_vocab = 0;
    std::unique_ptr<rp_hf_info> hf; // models built from a Hugging Face config only
};

struct rp_loss {
    rp::LossKind kind = rp::LossKind::Output;
    double scale = 1.0;
    rp_loss_fn fn = nullptr;
    void *user_data = nullptr;
};

struct rp_optimizer {
    rp::OptimizerSettings settings;
};

struct rp_tensor_list {
    std::vector<at::Tensor> tensors;
};

// A model handle over `layers` (at least one), remembering the vocabularies of its token layers.
inline std::unique_ptr<rp_model> make_model_handle(std::vector<std::unique_ptr<rp::Layer>> layers,
                                                   const rp::ModelOptions &options) {
    auto handle = std::make_unique<rp_model>();
    if (layers.front()->type() == "token_embedding")
        handle->input_vocab = rp::token_layer_vocab(*layers.front());
    if (layers.back()->type() == "lm_head")
        handle->label_vocab = rp::token_layer_vocab(*layers.back());
    handle->model = std::make_unique<rp::Model>(std::move(layers), options);
    return handle;
}
