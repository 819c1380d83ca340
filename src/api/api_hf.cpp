// Hugging Face model directories: create from config (+ weights), load weights, save back.
#include "api/api_guard.h"
#include "api/handles.h"
#include "layers/spec_parser.h"

using namespace rp;

namespace {

// Our names and Hugging Face names of every parameter with a master weight of its own, in the
// parameter store's order, with the shapes the layers expect.
struct ParamNames {
    std::vector<std::string> ours;
    std::vector<HfTensorSpec> hf;
};

ParamNames param_names(const HfModelConfig &config,
                       const std::vector<std::unique_ptr<Layer>> &layers) {
    ParamNames n;
    for (size_t l = 0; l < layers.size(); ++l)
        for (const ParamSpec &spec : layers[l]->params()) {
            if (!spec.tied_to.empty())
                continue;
            n.ours.push_back(std::to_string(l) + "." + spec.name);
            n.hf.push_back({hf_tensor_name(config, n.ours.back()), spec.shape});
        }
    return n;
}

std::vector<std::string> ignored_tensors(const HfModelConfig &config) {
    // Some tied checkpoints still store the head; the embedding is the one that counts.
    return config.tied ? std::vector<std::string>{"lm_head.weight"} : std::vector<std::string>{};
}

// Copies validated checkpoint tensors into the master weights (converting on the fly, no second
// copy of the model), then publishes them; accumulated gradients are dropped as by
// rp_model_load.
void install(Model &m, const ParamNames &names, const HfCheckpoint &ckpt) {
    std::vector<size_t> index;
    for (const std::string &name : names.ours) {
        int64_t i = m.params().find(name);
        if (i < 0)
            fail(ErrorKind::Internal,
                 "parameter \"" + name + "\" of the layers is not in the store");
        index.push_back(static_cast<size_t>(i));
    }
    m.synchronize();
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < index.size(); ++k)
        m.params().at(index[k]).master.copy_(ckpt.tensors[k]);
    m.synchronize();
    m.zero_grad();
}

rp_model *create(const HfModelConfig &config, const rp_model_options *options,
                 const std::string *dir) {
    ModelOptions opts = options ? options->options : ModelOptions();
    // Weights that a checkpoint overwrites are not drawn first (init_std 0: zero-filled).
    HfModelConfig layer_config = config;
    if (dir)
        layer_config.init_std = 0.0;
    auto layers = parse_model_spec(hf_model_spec(layer_config));
    ParamNames names = param_names(config, layers);
    // The checkpoint is validated before the model (and its memory) exists.
    HfCheckpoint ckpt;
    if (dir)
        ckpt = open_hf_checkpoint(*dir, names.hf, ignored_tensors(config));
    auto handle = make_model_handle(std::move(layers), opts);
    handle->hf = std::make_unique<rp_hf_info>();
    handle->hf->config = config;
    if (dir) {
        install(*handle->model, names, ckpt);
        handle->hf->layout = ckpt.layout;
    }
    return handle.release();
}

rp_hf_info &hf_of(rp_model *model) {
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
        *out_model = create(config, options, &d);
    });
}

rp_status rp_model_create_from_hf_config(rp_model **out_model, const char *config_json,
                                         const rp_model_options *options) {
    return guard([&] {
        require_arg(out_model, "out_model is NULL");
        require_arg(config_json, "config_json is NULL");
        HfModelConfig config =
            parse_hf_config(config_json, "config_json", ErrorKind::InvalidArgument);
        *out_model = create(config, options, nullptr);
    });
}

rp_status rp_model_load_hf(rp_model *model, const char *dir) {
    return guard([&] {
        rp_hf_info &hf = hf_of(model);
        require_arg(dir, "dir is NULL");
        Model &m = *model->model;
        require(!m.on_optimizer_thread(),
                "rp_model_load_hf may not be called from a step callback");
        // The layers are rebuilt from the config only to list the parameters and their shapes.
        auto layers = parse_model_spec(hf_model_spec(hf.config));
        ParamNames names = param_names(hf.config, layers);
        HfCheckpoint ckpt = open_hf_checkpoint(dir, names.hf, ignored_tensors(hf.config));
        install(m, names, ckpt);
        hf.layout = ckpt.layout;
    });
}

rp_status rp_model_save_hf(rp_model *model, const char *dir) {
    return guard([&] {
        rp_hf_info &hf = hf_of(model);
        require_arg(dir, "dir is NULL");
        Model &m = *model->model;
        require(!m.on_optimizer_thread(),
                "rp_model_save_hf may not be called from a step callback");
        m.synchronize();
        std::vector<NamedTensor> tensors;
        for (size_t i = 0; i < m.params().size(); ++i)
            tensors.push_back(
                {hf_tensor_name(hf.config, m.params().at(i).name), m.params().at(i).live});
        save_hf_checkpoint(dir, hf.layout, tensors,
                           hf_config_for_save(hf.config, m.params().model_dtype()));
    });
}

} // extern "C"
