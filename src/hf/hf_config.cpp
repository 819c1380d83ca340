#include "hf/hf_config.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

namespace rp {
namespace {

using json = nlohmann::json;

const char *const kArchitectures[] = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                      "LlamaForCausalLM"};

// Typed reads of config entries with messages that name the file and the key. A key that is
// absent or null takes the default of the transformers config class.
class ConfigReader {
  public:
    ConfigReader(const json &root, std::string where) : root_(root), where_(std::move(where)) {}

    [[noreturn]] void unsupported(const std::string &what) const {
        fail(ErrorKind::InvalidArgument, where_ + ": " + what);
    }

    const json *find(const json &obj, const std::string &key) const {
        auto it = obj.find(key);
        return it == obj.end() || it->is_null() ? nullptr : &*it;
    }

    int64_t positive(const std::string &key) const {
        const json *v = find(root_, key);
        if (!v)
            unsupported("missing \"" + key + "\"");
        return positive_value(*v, key);
    }

    int64_t positive_or(const std::string &key, int64_t fallback) const {
        const json *v = find(root_, key);
        return v ? positive_value(*v, key) : fallback;
    }

    int64_t non_negative_or(const std::string &key, int64_t fallback) const {
        const json *v = find(root_, key);
        if (!v)
            return fallback;
        if (!v->is_number_integer() || v->get<int64_t>() < 0)
            unsupported("\"" + key + "\" must be a non-negative integer, got " + v->dump());
        return v->get<int64_t>();
    }

    double number(const json &obj, const std::string &key, double fallback) const {
        const json *v = find(obj, key);
        if (!v)
            return fallback;
        if (!v->is_number())
            unsupported("\"" + key + "\" must be a number, got " + v->dump());
        return v->get<double>();
    }

    bool flag(const std::string &key, bool fallback) const {
        const json *v = find(root_, key);
        if (!v)
            return fallback;
        if (!v->is_boolean())
            unsupported("\"" + key + "\" must be true or false, got " + v->dump());
        return v->get<bool>();
    }

    std::string text(const json &obj, const std::string &key, const std::string &fallback) const {
        const json *v = find(obj, key);
        if (!v)
            return fallback;
        if (!v->is_string())
            unsupported("\"" + key + "\" must be a string, got " + v->dump());
        return v->get<std::string>();
    }

  private:
    int64_t positive_value(const json &v, const std::string &key) const {
        if (!v.is_number_integer() || v.get<int64_t>() <= 0)
            unsupported("\"" + key + "\" must be a positive integer, got " + v.dump());
        return v.get<int64_t>();
    }

    const json &root_;
    std::string where_;
};

RopeSpec read_rope(const json &root, const ConfigReader &r, int64_t max_positions) {
    // transformers 5 writes "rope_parameters"; older checkpoints "rope_theta" and "rope_scaling".
    json params = json::object();
    if (const json *p = r.find(root, "rope_parameters"))
        params = *p;
    else if (const json *s = r.find(root, "rope_scaling"))
        params = *s;
    if (!params.is_object())
        r.unsupported("\"rope_parameters\" must be an object, got " + params.dump());
    if (params.contains("full_attention") && params["full_attention"].is_object())
        params = params["full_attention"]; // per-layer-type form: every layer is full attention
    RopeSpec rope;
    rope.theta = r.number(params, "rope_theta", r.number(root, "rope_theta", 10000.0));
    if (!(rope.theta > 0))
        r.unsupported("rope_theta must be positive");
    rope.type = r.text(params, "rope_type", r.text(params, "type", "default"));
    double partial =
        r.number(params, "partial_rotary_factor", r.number(root, "partial_rotary_factor", 1.0));
    if (partial != 1.0)
        r.unsupported("partial_rotary_factor " + std::to_string(partial) +
                      " is not supported (only 1.0)");
    if (rope.type == "default")
        return rope;
    if (rope.type != "linear" && rope.type != "llama3")
        r.unsupported("rope type \"" + rope.type +
                      "\" is not supported (supported: default, linear, llama3)");
    if (!r.find(params, "factor"))
        r.unsupported("rope type \"" + rope.type + "\" needs \"factor\"");
    rope.factor = r.number(params, "factor", 1.0);
    if (!(rope.factor > 0))
        r.unsupported("rope \"factor\" must be positive");
    if (rope.type == "linear")
        return rope;
    rope.low_freq_factor = r.number(params, "low_freq_factor", 1.0);
    rope.high_freq_factor = r.number(params, "high_freq_factor", 4.0);
    if (rope.low_freq_factor == rope.high_freq_factor || !(rope.low_freq_factor > 0))
        r.unsupported("llama3 rope needs positive, different low_freq_factor and high_freq_factor");
    const json *orig = r.find(params, "original_max_position_embeddings");
    if (orig && (!orig->is_number_integer() || orig->get<int64_t>() <= 0))
        r.unsupported("\"original_max_position_embeddings\" must be a positive integer");
    rope.original_max_positions = orig ? orig->get<int64_t>() : max_positions;
    return rope;
}

// Qwen3MoeForCausalLM's sparse MLP, with Qwen3MoeConfig's defaults for absent keys.
void read_moe(const json &root, const ConfigReader &r, HfModelConfig &c) {
    // transformers 5 writes "num_local_experts" (Qwen3MoeConfig maps num_experts to it); the
    // published checkpoints write "num_experts".
    const json *experts = r.find(root, "num_experts");
    const json *local = r.find(root, "num_local_experts");
    if (experts && local && *experts != *local)
        r.unsupported("\"num_experts\" (" + experts->dump() + ") and \"num_local_experts\" (" +
                      local->dump() + ") disagree");
    c.num_experts = r.non_negative_or(experts ? "num_experts" : "num_local_experts", 128);
    c.experts_per_token = r.positive_or("num_experts_per_tok", 8);
    if (c.num_experts > 0 && c.experts_per_token > c.num_experts)
        r.unsupported("num_experts_per_tok (" + std::to_string(c.experts_per_token) +
                      ") must not exceed num_experts (" + std::to_string(c.num_experts) + ")");
    c.moe_intermediate = r.positive_or("moe_intermediate_size", 768);
    if (c.moe_intermediate > std::numeric_limits<int64_t>::max() / 2) // gate_up holds 2x rows
        r.unsupported("moe_intermediate_size " + std::to_string(c.moe_intermediate) +
                      " is too large");
    c.norm_topk_prob = r.flag("norm_topk_prob", false);
    c.decoder_sparse_step = r.positive_or("decoder_sparse_step", 1);
    if (const json *only = r.find(root, "mlp_only_layers")) {
        if (!only->is_array())
            r.unsupported("\"mlp_only_layers\" must be a list of layer indices, got " +
                          only->dump());
        for (const json &i : *only) {
            if (!i.is_number_integer() || i.get<int64_t>() < 0 || i.get<int64_t>() >= c.layers)
                r.unsupported("\"mlp_only_layers\" holds " + i.dump() +
                              ", not a layer index in [0, num_hidden_layers = " +
                              std::to_string(c.layers) + ")");
            c.mlp_only_layers.push_back(i.get<int64_t>());
        }
    }
    // transformers adds router_aux_loss_coef times the load-balancing loss of Switch
    // Transformer to the labels= loss when output_router_logits is true. That loss is a product
    // of two means over every token of the batch and every sparse layer (expert counts times
    // router probabilities): its value and gradient for a token need the counts of all
    // microbatches through all layers, which a pipeline that back-propagates the first
    // microbatch before the last has gone forward does not have. It is refused rather than
    // approximated per microbatch (docs/semantics.md, "Mixture-of-experts decoder layer").
    const double coef = r.number(root, "router_aux_loss_coef", 0.001);
    if (!std::isfinite(coef))
        r.unsupported("\"router_aux_loss_coef\" must be finite, got " + std::to_string(coef));
    if (r.flag("output_router_logits", false) && coef != 0.0)
        r.unsupported("\"output_router_logits\": true is not supported: transformers then adds "
                      "router_aux_loss_coef times the load-balancing loss, a product of means "
                      "over all microbatches and sparse layers that a pipelined per-microbatch "
                      "computation cannot reproduce; set \"output_router_logits\" to false (the "
                      "loss is then the causal-LM loss alone, as transformers computes it by "
                      "default) or \"router_aux_loss_coef\" to 0");
}

} // namespace

HfModelConfig parse_hf_config(const std::string &json_text, const std::string &where,
                              ErrorKind parse_error) {
    json root;
    try {
        root = json::parse(json_text);
    } catch (const json::exception &e) { // syntax, and numbers out of range (1e400)
        fail(parse_error, where + ": not valid JSON: " + e.what());
    }
    if (!root.is_object())
        fail(parse_error, where + ": must be a JSON object");
    ConfigReader r(root, where);

    HfModelConfig c;
    const json *arch = r.find(root, "architectures");
    if (!arch || !arch->is_array() || arch->size() != 1 || !(*arch)[0].is_string())
        r.unsupported("\"architectures\" must list exactly one architecture, got " +
                      (arch ? arch->dump() : std::string("nothing")));
    c.architecture = (*arch)[0].get<std::string>();
    bool known = false;
    for (const char *a : kArchitectures)
        known = known || c.architecture == a;
    if (!known)
        r.unsupported("architecture \"" + c.architecture +
                      "\" is not supported (supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
                      "LlamaForCausalLM)");
    const bool qwen3 = c.architecture == "Qwen3ForCausalLM";
    const bool qwen3_moe = c.architecture == "Qwen3MoeForCausalLM";

    c.vocab = r.positive("vocab_size");
    c.hidden = r.positive("hidden_size");
    c.intermediate = r.positive("intermediate_size");
    c.layers = r.positive("num_hidden_layers");
    c.heads = r.positive("num_attention_heads");
    c.kv_heads = r.positive_or("num_key_value_heads", c.heads);
    if (c.heads % c.kv_heads != 0)
        r.unsupported("num_attention_heads (" + std::to_string(c.heads) +
                      ") must be a multiple of num_key_value_heads (" + std::to_string(c.kv_heads) +
                      ")");
    // Defaults of the transformers classes: Qwen3Config has head_dim 128, LlamaConfig and
    // Qwen3MoeConfig derive it.
    if (!qwen3 && !r.find(root, "head_dim") && c.hidden % c.heads != 0)
        r.unsupported("hidden_size is not a multiple of num_attention_heads; give \"head_dim\"");
    c.head_dim = r.positive_or("head_dim", qwen3 ? 128 : c.hidden / c.heads);
    if (c.head_dim % 2 != 0)
        r.unsupported("head_dim must be even for rotary embeddings");
    if (c.head_dim > kMaxHeadDim)
        r.unsupported("head_dim " + std::to_string(c.head_dim) + " is larger than the " +
                      std::to_string(kMaxHeadDim) + " supported");
    c.eps = r.number(root, "rms_norm_eps", 1e-6);
    if (!(c.eps >= 0 && c.eps <= 1))
        r.unsupported("rms_norm_eps must be in [0, 1]");
    c.init_std = r.number(root, "initializer_range", 0.02);
    if (!(c.init_std >= 0 && c.init_std <= 1))
        r.unsupported("initializer_range must be in [0, 1]");
    c.tied = r.flag("tie_word_embeddings", false);
    c.attention_bias = r.flag("attention_bias", false);
    c.mlp_bias = qwen3 || qwen3_moe ? false : r.flag("mlp_bias", false);
    c.qk_norm = qwen3 || qwen3_moe;
    c.rope = read_rope(root, r,
                       r.positive_or("max_position_embeddings", qwen3 || qwen3_moe ? 32768 : 2048));
    if (qwen3_moe)
        read_moe(root, r, c);

    std::string act = r.text(root, "hidden_act", "silu");
    if (act != "silu")
        r.unsupported("hidden_act \"" + act + "\" is not supported (only \"silu\")");
    if (r.number(root, "attention_dropout", 0.0) != 0.0)
        r.unsupported("attention_dropout > 0 is not supported");
    if ((qwen3 || qwen3_moe) && r.flag("use_sliding_window", false))
        r.unsupported("use_sliding_window is not supported");
    if (const json *types = r.find(root, "layer_types")) {
        if (!types->is_array())
            r.unsupported("\"layer_types\" must be a list");
        for (const json &t : *types)
            if (t != "full_attention")
                r.unsupported("layer type " + t.dump() +
                              " is not supported (only \"full_attention\")");
    }
    c.json_text = json_text;
    return c;
}

bool HfModelConfig::sparse_layer(int64_t i) const {
    if (num_experts == 0 || (i + 1) % decoder_sparse_step != 0)
        return false;
    return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) == mlp_only_layers.end();
}

int64_t HfModelConfig::sparse_layer_count() const {
    if (num_experts == 0)
        return 0;
    std::vector<int64_t> dense(mlp_only_layers);
    std::sort(dense.begin(), dense.end());
    dense.erase(std::unique(dense.begin(), dense.end()), dense.end());
    int64_t count = layers / decoder_sparse_step;
    for (int64_t i : dense)
        count -= (i + 1) % decoder_sparse_step == 0 ? 1 : 0;
    return count;
}

std::string hf_tensor_name(const HfModelConfig &c, const std::string &name) {
    const size_t dot = name.find('.');
    require(dot != std::string::npos && dot > 0, "parameter name \"" + name + "\" has no layer");
    const int64_t layer = std::stoll(name.substr(0, dot));
    const std::string local = name.substr(dot + 1);
    if (layer == 0)
        return "model.embed_tokens." + local;
    if (layer <= c.layers)
        return "model.layers." + std::to_string(layer - 1) + "." + local;
    if (layer == c.layers + 1)
        return "model.norm." + local;
    return "lm_head." + local;
}

namespace {

bool ends_with(const std::string &s, const std::string &tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

} // namespace

at::Tensor HfStoredTensor::part_of(const at::Tensor &param) const {
    return expert < 0 ? param : param.select(0, expert).narrow(0, row, shape[0]);
}

std::vector<HfStoredTensor> hf_stored_tensors(const std::string &name,
                                              const std::vector<int64_t> &shape) {
    const std::string gate_up = ".experts.gate_up_proj", down = ".experts.down_proj";
    const bool is_gate_up = ends_with(name, gate_up);
    if ((!is_gate_up && !ends_with(name, down)) || shape.size() != 3)
        return {{name, shape}};
    const std::string prefix =
        name.substr(0, name.size() - (is_gate_up ? gate_up : down).size()) + ".experts.";
    std::vector<HfStoredTensor> stored;
    for (int64_t e = 0; e < shape[0]; ++e) {
        const std::string expert = prefix + std::to_string(e);
        if (is_gate_up) {
            const int64_t rows = shape[1] / 2;
            stored.push_back({expert + ".gate_proj.weight", {rows, shape[2]}, e, 0});
            stored.push_back({expert + ".up_proj.weight", {rows, shape[2]}, e, rows});
        } else {
            stored.push_back({expert + ".down_proj.weight", {shape[1], shape[2]}, e, 0});
        }
    }
    return stored;
}

std::string hf_config_for_save(const HfModelConfig &c, at::ScalarType dtype) {
    json root = json::parse(c.json_text);
    const char *name = dtype == at::kBFloat16 ? "bfloat16"
                       : dtype == at::kHalf   ? "float16"
                                              : "float32";
    // transformers 5 writes "dtype"; older versions "torch_dtype". Keep whichever is there.
    bool legacy = root.contains("torch_dtype") && !root.contains("dtype");
    root[legacy ? "torch_dtype" : "dtype"] = name;
    return root.dump(2) + "\n";
}

} // namespace rp
