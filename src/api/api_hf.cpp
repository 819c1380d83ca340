// Hugging Face model directories: argument checks around src/hf.
#include "api/api_guard.h"
#include "api/handles.h"
#include "api/model_call.h"
#include "hf/hf_lora.h"

using namespace rp;

namespace {

rp_model *handle_of(HfModel built) {
    auto handle = std::make_unique<rp_model>();
    handle->model = std::move(built.model);
    handle->hf = std::move(built.info);
    handle->lora_targets = rp::lora_targets_text(handle->hf->lora.targets);
    return handle.release();
}

ModelOptions options_of(const rp_model_options *options) {
    return options ? options->options : ModelOptions();
}

LoraSpec lora_of(const rp_model_options *options) {
    return options ? options->lora : LoraSpec();
}

HfModelInfo &hf_of(rp_model *model) {
    require_arg(model && model->model, "model is NULL");
    if (!model->hf)
        fail(ErrorKind::State, "the model was not built from a Hugging Face config "
                               "(rp_model_create_from_hf or rp_model_create_from_hf_config)");
    return *model->hf;
}

} // namespace

extern "C" {

rp_status rp_model_create_from_hf(rp_model **out_model, const char *dir,
                                  const rp_model_options *options) {
    return guard([&] {
        require_arg(out_model, "out_model is NULL");
        require_arg(dir, "dir is NULL");
        const std::string d = dir;
        const std::string path = (d.empty() || d.back() == '/' ? d : d + "/") + "config.json";
        HfModelConfig config = parse_hf_config(read_hf_config_text(d), path, ErrorKind::Io);
        *out_model = handle_of(create_hf_model(config, options_of(options), lora_of(options), &d));
    });
}

rp_status rp_model_create_from_hf_config(rp_model **out_model, const char *config_json,
                                         const rp_model_options *options) {
    return guard([&] {
        require_arg(out_model, "out_model is NULL");
        require_arg(config_json, "config_json is NULL");
        HfModelConfig config =
            parse_hf_config(config_json, "config_json", ErrorKind::InvalidArgument);
        *out_model = handle_of(create_hf_model(config, options_of(options), lora_of(options), nullptr));
    });
}

rp_status rp_model_load_hf(rp_model *model, const char *dir) {
    return guard([&] {
        ModelCall hold(model);
        HfModelInfo &hf = hf_of(model);
        require_arg(dir, "dir is NULL");
        require(!model->model->on_optimizer_thread(),
                "rp_model_load_hf may not be called from a step callback");
        load_hf_weights(*model->model, hf, dir);
    });
}

rp_status rp_model_save_hf(rp_model *model, const char *dir) {
    return guard([&] {
        ModelCall hold(model);
        HfModelInfo &hf = hf_of(model);
        require_arg(dir, "dir is NULL");
        require(!model->model->on_optimizer_thread(),
                "rp_model_save_hf may not be called from a step callback");
        if (!model->model->writes_checkpoints()) { // data parallel: rank 0 writes
            model->model->synchronize();
            return;
        }
        save_hf_model(*model->model, hf, dir);
    });
}

rp_status rp_model_lora(int32_t *out_rank, double *out_alpha, double *out_dropout,
                        const char **out_target_modules, const rp_model *model) {
    return guard([&] {
        require_arg(model && model->model, "model is NULL");
        const LoraSpec lora = model->hf ? model->hf->lora : LoraSpec();
        if (out_rank)
            *out_rank = static_cast<int32_t>(lora.rank);
        if (out_alpha)
            *out_alpha = lora.alpha;
        if (out_dropout)
            *out_dropout = lora.dropout;
        if (out_target_modules)
            *out_target_modules = model->lora_targets.c_str();
    });
}

rp_status rp_model_save_lora(rp_model *model, const char *dir, const char *base_model) {
    return guard([&] {
        ModelCall hold(model);
        HfModelInfo &hf = hf_of(model);
        require_arg(dir, "dir is NULL");
        require(!model->model->on_optimizer_thread(),
                "rp_model_save_lora may not be called from a step callback");
        require(hf.lora.enabled(), "the model has no LoRA adapters (rp_model_options_set_lora)");
        if (!model->model->writes_checkpoints()) { // data parallel: rank 0 writes
            model->model->synchronize();
            return;
        }
        save_lora_adapter(*model->model, hf, dir, base_model ? base_model : "");
    });
}

rp_status rp_model_load_lora(rp_model *model, const char *dir) {
    return guard([&] {
        ModelCall hold(model);
        HfModelInfo &hf = hf_of(model);
        require_arg(dir, "dir is NULL");
        require(!model->model->on_optimizer_thread(),
                "rp_model_load_lora may not be called from a step callback");
        load_lora_adapter(*model->model, hf, dir);
    });
}

rp_status rp_param_hf_name(const char **out_name, const rp_model *model, size_t index) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_name, "out_name is NULL");
        require_arg(model && model->model, "model is NULL");
        if (!model->hf)
            fail(ErrorKind::State, "the model was not built from a Hugging Face config, so its "
                                   "parameters have no Hugging Face names");
        const std::vector<std::string> &names = model->hf->tensor_names;
        require(index < names.size(), "parameter index " + std::to_string(index) +
                                          " is out of range (the model has " +
                                          std::to_string(names.size()) + ")");
        *out_name = names[index].c_str();
    });
}

} // extern "C"
