#include "hf/hf_model.h"

#include "layers/builtin_layers.h"
#include "layers/transformer_layers.h"

namespace rp {
namespace {

// The layer list of hf_config.h: token_embedding, decoder layers, rms_norm, lm_head.
std::vector<std::unique_ptr<Layer>> hf_layers(const HfModelConfig &c, double init_std) {
    DecoderSpec decoder;
    decoder.dim = c.hidden;
    decoder.heads = c.heads;
    decoder.kv_heads = c.kv_heads;
    decoder.head_dim = c.head_dim;
    decoder.hidden = c.intermediate;
    decoder.eps = c.eps;
    decoder.rope = c.rope;
    decoder.qk_norm = c.qk_norm;
    decoder.attention_bias = c.attention_bias;
    decoder.mlp_bias = c.mlp_bias;
    decoder.init_std = init_std;
    std::vector<std::unique_ptr<Layer>> layers;
    layers.push_back(make_token_embedding(c.vocab, c.hidden, init_std));
    for (int64_t i = 0; i < c.layers; ++i)
        layers.push_back(make_decoder_layer(decoder));
    layers.push_back(make_rms_norm(c.hidden, c.eps));
    layers.push_back(make_lm_head(c.hidden, c.vocab, c.tied ? "0.weight" : "", init_std,
                                  /*chunk_tokens=*/0));
    return layers;
}

// Hugging Face name and expected shape of every parameter with a master weight of its own, in
// the parameter store's order (the store skips tied parameters the same way).
std::vector<HfTensorSpec> tensor_specs(const HfModelConfig &config,
                                       const std::vector<std::unique_ptr<Layer>> &layers) {
    std::vector<HfTensorSpec> specs;
    for (size_t l = 0; l < layers.size(); ++l)
        for (const ParamSpec &spec : layers[l]->params())
            if (spec.tied_to.empty())
                specs.push_back(
                    {hf_tensor_name(config, std::to_string(l) + "." + spec.name), spec.shape});
    return specs;
}

std::vector<HfTensorSpec> tensor_specs(const HfModelInfo &info, const Model &model) {
    std::vector<HfTensorSpec> specs;
    for (size_t i = 0; i < model.params().size(); ++i)
        specs.push_back({info.tensor_names[i], model.params().at(i).master.sizes().vec()});
    return specs;
}

std::vector<std::string> ignored_tensors(const HfModelConfig &config) {
    // Some tied checkpoints still store the head; the embedding is the one that counts.
    return config.tied ? std::vector<std::string>{"lm_head.weight"} : std::vector<std::string>{};
}

// Copies validated checkpoint tensors into the master weights (converting on the fly, no second
// copy of the model), then publishes them; accumulated gradients are dropped as by
// rp_model_load.
void install(Model &m, const HfCheckpoint &ckpt) {
    m.synchronize();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < ckpt.tensors.size(); ++i)
        m.params().at(i).master.copy_(ckpt.tensors[i]);
    m.synchronize();
    m.zero_grad();
}

} // namespace

HfModel create_hf_model(const HfModelConfig &config, const ModelOptions &options,
                        const std::string *dir) {
    // Weights that a checkpoint overwrites are not drawn first (init_std 0: zero-filled).
    auto layers = hf_layers(config, dir ? 0.0 : config.init_std);
    std::vector<HfTensorSpec> specs = tensor_specs(config, layers);
    HfCheckpoint ckpt;
    if (dir)
        ckpt = open_hf_checkpoint(*dir, specs, ignored_tensors(config));
    HfModel out;
    out.info = std::make_unique<HfModelInfo>();
    out.info->config = config;
    for (const HfTensorSpec &spec : specs)
        out.info->tensor_names.push_back(spec.name);
    out.model = std::make_unique<Model>(std::move(layers), options);
    if (out.model->params().size() != specs.size())
        fail(ErrorKind::Internal, "the parameter store holds " +
                                      std::to_string(out.model->params().size()) +
                                      " parameters, the Hugging Face names " +
                                      std::to_string(specs.size()));
    if (dir) {
        install(*out.model, ckpt);
        out.info->layout = ckpt.layout;
    }
    return out;
}

void load_hf_weights(Model &model, HfModelInfo &info, const std::string &dir) {
    HfCheckpoint ckpt =
        open_hf_checkpoint(dir, tensor_specs(info, model), ignored_tensors(info.config));
    install(model, ckpt);
    info.layout = ckpt.layout;
}

void save_hf_model(Model &model, const HfModelInfo &info, const std::string &dir) {
    model.synchronize();
    std::vector<NamedTensor> tensors;
    for (size_t i = 0; i < model.params().size(); ++i)
        tensors.push_back({info.tensor_names[i], model.params().at(i).live});
    save_hf_checkpoint(dir, info.layout, tensors,
                       hf_config_for_save(info.config, model.params().model_dtype()));
}

} // namespace rp
