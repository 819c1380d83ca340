// What the opaque handles of roundpipe.h hold.
#pragma once
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "api/roundpipe_internal.h"
#include "engine/loss.h"
#include "engine/model.h"
#include "engine/run_config.h"
#include "hf/hf_model.h"

struct rp_run_config {
    rp::RunConfig config;
};

struct rp_model_options {
    rp::ModelOptions options;
};

struct rp_model {
    std::unique_ptr<rp::Model> model;
    std::atomic<bool> busy{false}; // an exported call holds the model (api/model_call.h)
    std::string trace_json; // backs the pointer rp_model_trace_json hands out
    std::unique_ptr<rp::HfModelInfo> hf; // models built from a Hugging Face config only
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
