#include "hf/hf_config.h"

#include <nlohmann/json.hpp>

namespace rp {
namespace {

using json = nlohmann::json;

const char *const kArchitectures[] = {"Qwen3ForCausalLM", "LlamaForCausalLM"};

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
                      "\" is not supported (supported: Qwen3ForCausalLM, LlamaForCausalLM)");
    const bool qwen3 = c.architecture == "Qwen3ForCausalLM";

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
    // Defaults of the transformers classes: Qwen3Config has head_dim 128, LlamaConfig derives it.
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
    c.mlp_bias = qwen3 ? false : r.flag("mlp_bias", false);
    c.qk_norm = qwen3;
    c.rope = read_rope(root, r, r.positive_or("max_position_embeddings", qwen3 ? 32768 : 2048));

    std::string act = r.text(root, "hidden_act", "silu");
    if (act != "silu")
        r.unsupported("hidden_act \"" + act + "\" is not supported (only \"silu\")");
    if (r.number(root, "attention_dropout", 0.0) != 0.0)
        r.unsupported("attention_dropout > 0 is not supported");
    if (qwen3 && r.flag("use_sliding_window", false))
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
