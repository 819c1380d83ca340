#include "hf/hf_model.h"

#include <algorithm>
#include <unordered_map>

#include "base/progress.h"
#include "layers/builtin_layers.h"
#include "layers/transformer_layers.h"

namespace rp {
namespace {

DecoderSpec decoder_spec(const HfModelConfig &c, double init_std, const LoraSpec &lora) {
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
    decoder.lora = lora;
    return decoder;
}

MoeSpec moe_spec(const HfModelConfig &c) {
    MoeSpec moe;
    moe.experts = c.num_experts;
    moe.top_k = c.experts_per_token;
    moe.expert_hidden = c.moe_intermediate;
    moe.norm_topk_prob = c.norm_topk_prob;
    return moe;
}

// Decoder layer `i` (0-based) of the config: dense or mixture-of-experts.
std::unique_ptr<Layer> make_hf_decoder_layer(const HfModelConfig &c, const DecoderSpec &decoder,
                                             int64_t i) {
    return c.sparse_layer(i) ? make_moe_decoder_layer(decoder, moe_spec(c))
                             : make_decoder_layer(decoder);
}

// Adapters go where PEFT puts them on the dense models. On a Qwen3-MoE model PEFT adapts the
// stacked experts and the router through parameter wrappers of its own, which RoundPipe does not
// have: only the attention projections may carry adapters there.
void check_lora_targets(const HfModelConfig &c, const LoraSpec &lora) {
    if (c.sparse_layer_count() > 0 && (lora.targets & ~kLoraAttentionTargets))
        fail(ErrorKind::InvalidArgument,
             "LoRA target modules " + lora_targets_text(lora.targets & ~kLoraAttentionTargets) +
                 " are not supported on the " + c.architecture +
                 " of the config: its experts are stacked tensors, not projections; adapters "
                 "exist on " +
                 lora_targets_text(kLoraAttentionTargets));
}

// A config is a few hundred bytes of text that may describe any number of layers: its host
// memory is checked from one decoder layer of each kind (dense, mixture-of-experts) before the
// layer list is built. With LoRA only the adapters are trainable; the rest costs its held bytes.
void check_fits_host(const HfModelConfig &c, const ModelOptions &options, const LoraSpec &lora) {
    const DecoderSpec decoder = decoder_spec(c, 0.0, lora);
    const int64_t sparse_layers = c.sparse_layer_count();
    int64_t total = 0, trainable = 0, embeddings = 0;
    bool too_many = false;
    for (const bool sparse : {false, true}) {
        const int64_t count = sparse ? sparse_layers : c.layers - sparse_layers;
        if (count == 0)
            continue;
        const auto layer =
            sparse ? make_moe_decoder_layer(decoder, moe_spec(c)) : make_decoder_layer(decoder);
        const int64_t per_layer = layer->own_param_elements();
        const int64_t per_layer_trainable = layer->own_param_elements(true);
        int64_t part = 0, part_trainable = 0;
        too_many = too_many || per_layer < 0 || __builtin_mul_overflow(per_layer, count, &part) ||
                   __builtin_mul_overflow(per_layer_trainable, count, &part_trainable) ||
                   __builtin_add_overflow(total, part, &total) ||
                   __builtin_add_overflow(trainable, part_trainable, &trainable);
    }
    too_many = too_many || __builtin_mul_overflow(c.vocab, c.hidden, &embeddings) ||
               (!c.tied && __builtin_add_overflow(embeddings, embeddings, &embeddings));
    for (int64_t part : {embeddings, c.hidden})
        too_many = __builtin_add_overflow(total, part, &total) || too_many;
    if (!lora.enabled())
        trainable = total;
    ParamStore::check_fits_host(too_many ? -1 : trainable, too_many ? -1 : total - trainable,
                                options.model_dtype, options.host_memory_mode,
                                "the " + c.architecture + " of the config");
}

// The layer list of hf_config.h: token_embedding, decoder layers, rms_norm, lm_head. With LoRA
// every parameter but the decoder layers' adapters is frozen.
std::vector<std::unique_ptr<Layer>> hf_layers(const HfModelConfig &c, double init_std,
                                              const LoraSpec &lora) {
    const DecoderSpec decoder = decoder_spec(c, init_std, lora);
    std::vector<std::unique_ptr<Layer>> layers;
    layers.push_back(make_token_embedding(c.vocab, c.hidden, init_std));
    for (int64_t i = 0; i < c.layers; ++i)
        layers.push_back(make_hf_decoder_layer(c, decoder, i));
    layers.push_back(make_rms_norm(c.hidden, c.eps));
    layers.push_back(make_lm_head(c.hidden, c.vocab, c.tied ? "0.weight" : "", init_std,
                                  /*chunk_tokens=*/0));
    if (lora.enabled()) // the decoder layers froze their own base weights
        for (size_t l : {size_t{0}, layers.size() - 2, layers.size() - 1})
            layers[l]->freeze_params();
    return layers;
}

// Hugging Face name and expected shape of every parameter with a master weight of its own, in
// the parameter store's order (the store skips tied parameters the same way), adapters included.
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

// The tensors of the model's Hugging Face checkpoints: those of every parameter but the
// adapters, with the shapes of `specs` (the store's order).
void index_checkpoint_tensors(HfModelInfo &info, const std::vector<HfTensorSpec> &specs) {
    for (size_t i : info.base_params)
        for (HfStoredTensor &stored : hf_stored_tensors(specs[i].name, specs[i].shape))
            info.checkpoint_tensors.push_back({i, std::move(stored)});
}

std::vector<HfTensorSpec> checkpoint_specs(const HfModelInfo &info) {
    std::vector<HfTensorSpec> specs;
    for (const HfCheckpointTensor &t : info.checkpoint_tensors)
        specs.push_back({t.stored.name, t.stored.shape});
    return specs;
}

// Which parameters are adapters, and the adapter of each adapted weight, from the names.
void index_adapters(HfModelInfo &info) {
    std::unordered_map<std::string, size_t> index; // of the adapters, by name
    for (size_t i = 0; i < info.tensor_names.size(); ++i) {
        const bool adapter = is_lora_adapter(info.tensor_names[i]);
        (adapter ? info.adapter_params : info.base_params).push_back(i);
        if (adapter)
            index.emplace(info.tensor_names[i], i);
    }
    const std::string suffix = ".weight";
    for (size_t i : info.base_params) {
        const std::string &name = info.tensor_names[i];
        if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(),
                                                         suffix.size(), suffix) != 0)
            continue;
        const std::string module = name.substr(0, name.size() - suffix.size());
        auto a = index.find(module + ".lora_A.weight"), b = index.find(module + ".lora_B.weight");
        if (a != index.end() && b != index.end())
            info.lora_pairs.push_back({i, a->second, b->second});
    }
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
void install(Model &m, const HfModelInfo &info, const HfCheckpoint &ckpt,
             ProgressReport &progress) {
    m.synchronize();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < ckpt.tensors.size(); ++i) {
        const HfCheckpointTensor &t = info.checkpoint_tensors[i];
        copy_reporting(t.stored.part_of(m.params().at(t.param).master), ckpt.tensors[i], progress);
    }
    m.synchronize();
    m.zero_grad();
    progress.finish();
}

} // namespace

HfModel create_hf_model(const HfModelConfig &config, const ModelOptions &options,
                        const LoraSpec &lora, const std::string *dir) {
    if (lora.enabled()) {
        check_lora_spec(lora);
        check_lora_targets(config, lora);
    }
    check_fits_host(config, options, lora);
    // Weights that a checkpoint overwrites are not drawn first (init_std 0: zero-filled).
    auto layers = hf_layers(config, dir ? 0.0 : config.init_std, lora);
    const std::vector<HfTensorSpec> specs = tensor_specs(config, layers);
    HfModel out;
    out.info = std::make_unique<HfModelInfo>();
    out.info->config = config;
    out.info->lora = lora;
    for (const HfTensorSpec &spec : specs)
        out.info->tensor_names.push_back(spec.name);
    index_adapters(*out.info);
    index_checkpoint_tensors(*out.info, specs);
    HfCheckpoint ckpt;
    std::unique_ptr<ProgressReport> progress;
    if (dir) {
        ckpt = open_hf_checkpoint(*dir, checkpoint_specs(*out.info), ignored_tensors(config));
        // Reported from here: building the model below takes part of the time.
        progress = std::make_unique<ProgressReport>("load " + *dir, checkpoint_bytes(ckpt));
    }
    out.model = std::make_unique<Model>(std::move(layers), options);
    if (out.model->params().size() != specs.size())
        fail(ErrorKind::Internal, "the parameter store holds " +
                                      std::to_string(out.model->params().size()) +
                                      " parameters, the Hugging Face names " +
                                      std::to_string(specs.size()));
    if (dir) {
        install(*out.model, *out.info, ckpt, *progress);
        out.info->layout = ckpt.layout;
    }
    return out;
}

void load_hf_weights(Model &model, HfModelInfo &info, const std::string &dir) {
    HfCheckpoint ckpt =
        open_hf_checkpoint(dir, checkpoint_specs(info), ignored_tensors(info.config));
    ProgressReport progress("load " + dir, checkpoint_bytes(ckpt));
    install(model, info, ckpt, progress);
    info.layout = ckpt.layout;
}

void save_hf_model(Model &model, const HfModelInfo &info, const std::string &dir) {
    model.synchronize();
    const ParamStore &store = model.params();
    std::unordered_map<size_t, const LoraPair *> adapter_of; // by adapted parameter
    for (const LoraPair &pair : info.lora_pairs)
        adapter_of.emplace(pair.base, &pair);
    const double scaling = info.lora.enabled() ? info.lora.scaling() : 0.0;
    std::vector<NamedTensor> tensors;
    for (const HfCheckpointTensor &t : info.checkpoint_tensors) {
        const at::Tensor w = t.stored.part_of(store.at(t.param).live);
        tensors.push_back({t.stored.name, w});
        auto adapted = adapter_of.find(t.param);
        if (adapted == adapter_of.end())
            continue;
        const at::Tensor a = store.at(adapted->second->a).master;
        const at::Tensor b = store.at(adapted->second->b).master;
        tensors.back().tensor = at::empty(w.sizes(), w.options().device(at::kMeta));
        // Made when the writer reaches it: W + (alpha / r) B A in fp32, rounded once.
        tensors.back().produce = [w, a, b, scaling] {
            at::NoGradGuard no_grad;
            return at::addmm(w.to(at::kFloat), b, a, /*beta=*/1.0, /*alpha=*/scaling)
                .to(w.scalar_type());
        };
    }
    save_hf_checkpoint(dir, info.layout, tensors,
                       hf_config_for_save(info.config, model.params().model_dtype()));
}

} // namespace rp
