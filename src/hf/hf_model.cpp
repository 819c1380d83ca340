#include "hf/hf_model.h"

#include <algorithm>

#include "base/progress.h"
#include "layers/builtin_layers.h"
#include "layers/transformer_layers.h"

namespace rp {
namespace {

DecoderSpec decoder_spec(const HfModelConfig &c, double init_std) {
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
    return decoder;
}

// A config is a few hundred bytes of text that may describe any number of layers: its host
// memory is checked from one decoder layer's parameters before the layer list is built.
void check_fits_host(const HfModelConfig &c, const ModelOptions &options) {
    const int64_t per_layer = make_decoder_layer(decoder_spec(c, 0.0))->own_param_elements();
    int64_t total = 0, embeddings = 0;
    bool too_many = per_layer < 0 || __builtin_mul_overflow(per_layer, c.layers, &total) ||
                    __builtin_mul_overflow(c.vocab, c.hidden, &embeddings) ||
                    (!c.tied && __builtin_add_overflow(embeddings, embeddings, &embeddings));
    for (int64_t part : {embeddings, c.hidden})
        too_many = __builtin_add_overflow(total, part, &total) || too_many;
    ParamStore::check_fits_host(too_many ? -1 : total, options.model_dtype,
                                options.host_memory_mode,
                                "the " + c.architecture + " of the config");
}

// The layer list of hf_config.h: token_embedding, decoder layers, rms_norm, lm_head.
std::vector<std::unique_ptr<Layer>> hf_layers(const HfModelConfig &c, double init_std) {
    const DecoderSpec decoder = decoder_spec(c, init_std);
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

int64_t checkpoint_bytes(const HfCheckpoint &ckpt) {
    int64_t total = 0;
    for (const at::Tensor &t : ckpt.tensors)
        total += t.numel() * static_cast<int64_t>(t.element_size());
    return total;
}

// Copies `src` into `dst` in pieces, so that progress moves inside large tensors (an embedding
// is often a tenth of the model). Reading the mapped pieces is what faults the file in.
void copy_reporting(const at::Tensor &dst, const at::Tensor &src, ProgressReport &progress) {
    constexpr int64_t kPieceBytes = int64_t{64} << 20;
    const int64_t element = static_cast<int64_t>(src.element_size());
    if (!dst.is_contiguous() || !src.is_contiguous()) {
        dst.copy_(src);
        progress.advance(src.numel() * element);
        return;
    }
    at::Tensor d = dst.view(-1), s = src.view(-1);
    const int64_t piece = std::max<int64_t>(1, kPieceBytes / element);
    for (int64_t at = 0; at < s.numel(); at += piece) {
        const int64_t n = std::min(piece, s.numel() - at);
        d.narrow(0, at, n).copy_(s.narrow(0, at, n));
        progress.advance(n * element);
    }
}

// Copies validated checkpoint tensors into the master weights (converting on the fly, no second
// copy of the model), then publishes them; accumulated gradients are dropped as by
// rp_model_load.
void install(Model &m, const HfCheckpoint &ckpt, ProgressReport &progress) {
    m.synchronize();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < ckpt.tensors.size(); ++i)
        copy_reporting(m.params().at(i).master, ckpt.tensors[i], progress);
    m.synchronize();
    m.zero_grad();
    progress.finish();
}

} // namespace

HfModel create_hf_model(const HfModelConfig &config, const ModelOptions &options,
                        const std::string *dir) {
    check_fits_host(config, options);
    // Weights that a checkpoint overwrites are not drawn first (init_std 0: zero-filled).
    auto layers = hf_layers(config, dir ? 0.0 : config.init_std);
    std::vector<HfTensorSpec> specs = tensor_specs(config, layers);
    HfCheckpoint ckpt;
    std::unique_ptr<ProgressReport> progress;
    if (dir) {
        ckpt = open_hf_checkpoint(*dir, specs, ignored_tensors(config));
        // Reported from here: building the model below takes part of the time.
        progress = std::make_unique<ProgressReport>("load " + *dir, checkpoint_bytes(ckpt));
    }
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
        install(*out.model, ckpt, *progress);
        out.info->layout = ckpt.layout;
    }
    return out;
}

void load_hf_weights(Model &model, HfModelInfo &info, const std::string &dir) {
    HfCheckpoint ckpt =
        open_hf_checkpoint(dir, tensor_specs(info, model), ignored_tensors(info.config));
    ProgressReport progress("load " + dir, checkpoint_bytes(ckpt));
    install(model, ckpt, progress);
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
