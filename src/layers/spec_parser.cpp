#include "layers/spec_parser.h"

#include <cmath>
#include <set>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "layers/builtin_layers.h"
#include "layers/transformer_layers.h"

namespace rp {
namespace {

using json = nlohmann::json;

// Reads the arguments of one layer entry and rejects anything it did not read, so a typo such
// as "hiden" fails loudly instead of silently taking a default.
class LayerArgs {
  public:
    LayerArgs(const json &entry, size_t index, std::string type)
        : entry_(entry), prefix_("layer " + std::to_string(index) + " (" + type + "): ") {
        used_.insert("type");
    }

    [[noreturn]] void error(const std::string &what) const {
        fail(ErrorKind::InvalidArgument, prefix_ + what);
    }

    int64_t positive_int(const std::string &key) {
        const json *v = find(key);
        if (!v)
            error("missing \"" + key + "\" (a positive integer)");
        if (!v->is_number_integer() || v->get<int64_t>() <= 0)
            error("\"" + key + "\" must be a positive integer, got " + v->dump());
        return v->get<int64_t>();
    }

    int64_t integer(const std::string &key, int64_t fallback) {
        const json *v = find(key);
        if (!v)
            return fallback;
        if (!v->is_number_integer())
            error("\"" + key + "\" must be an integer, got " + v->dump());
        return v->get<int64_t>();
    }

    double number(const std::string &key, double fallback, double lo, double hi, bool hi_open) {
        const json *v = find(key);
        if (!v)
            return fallback;
        if (!v->is_number())
            error("\"" + key + "\" must be a number, got " + v->dump());
        double x = v->get<double>();
        if (!std::isfinite(x) || x < lo || x > hi || (hi_open && x == hi))
            error("\"" + key + "\" = " + v->dump() + " is out of range [" + std::to_string(lo) +
                  ", " + std::to_string(hi) + (hi_open ? ")" : "]"));
        return x;
    }

    bool boolean(const std::string &key, bool fallback) {
        const json *v = find(key);
        if (!v)
            return fallback;
        if (!v->is_boolean())
            error("\"" + key + "\" must be true or false, got " + v->dump());
        return v->get<bool>();
    }

    std::string choice(const std::string &key, const std::string &fallback,
                       const std::vector<std::string> &allowed) {
        const json *v = find(key);
        if (!v)
            return fallback;
        if (v->is_string())
            for (const std::string &a : allowed)
                if (v->get<std::string>() == a)
                    return a;
        std::string list;
        for (const std::string &a : allowed)
            list += (list.empty() ? "" : ", ") + ("\"" + a + "\"");
        error("\"" + key + "\" must be one of " + list + ", got " + v->dump());
    }

    std::string text(const std::string &key, const std::string &fallback) {
        const json *v = find(key);
        if (!v)
            return fallback;
        if (!v->is_string())
            error("\"" + key + "\" must be a string, got " + v->dump());
        return v->get<std::string>();
    }

    bool has(const std::string &key) const { return entry_.contains(key); }

    std::vector<int64_t> shape(const std::string &key) {
        const json *v = find(key);
        if (!v || !v->is_array() || v->empty())
            error("\"" + key + "\" must be a non-empty list of integers");
        std::vector<int64_t> out;
        int inferred = 0;
        for (const json &d : *v) {
            if (!d.is_number_integer() || (d.get<int64_t>() <= 0 && d.get<int64_t>() != -1))
                error("\"" + key + "\" entries must be positive integers or -1, got " + d.dump());
            inferred += d.get<int64_t>() == -1;
            out.push_back(d.get<int64_t>());
        }
        if (inferred > 1)
            error("\"" + key + "\" may hold at most one -1");
        return out;
    }

    void finish() const {
        for (auto it = entry_.begin(); it != entry_.end(); ++it)
            if (!used_.count(it.key()))
                error("unknown argument \"" + it.key() + "\"");
    }

  private:
    const json *find(const std::string &key) {
        used_.insert(key);
        auto it = entry_.find(key);
        return it == entry_.end() ? nullptr : &*it;
    }

    const json &entry_;
    std::string prefix_;
    std::set<std::string> used_;
};

const std::vector<std::string> kActivations = {"gelu", "relu", "silu", "tanh"};

DecoderSpec decoder_spec(LayerArgs &a) {
    DecoderSpec s;
    s.dim = a.positive_int("dim");
    s.heads = a.positive_int("heads");
    s.kv_heads = a.has("kv_heads") ? a.positive_int("kv_heads") : s.heads;
    if (s.heads % s.kv_heads != 0)
        a.error("\"heads\" (" + std::to_string(s.heads) + ") must be a multiple of \"kv_heads\" (" +
                std::to_string(s.kv_heads) + ")");
    if (a.has("head_dim")) {
        s.head_dim = a.positive_int("head_dim");
    } else {
        if (s.dim % s.heads != 0)
            a.error("\"dim\" (" + std::to_string(s.dim) + ") is not a multiple of \"heads\" (" +
                    std::to_string(s.heads) + "); give \"head_dim\"");
        s.head_dim = s.dim / s.heads;
    }
    if (s.head_dim % 2 != 0)
        a.error("the head dimension must be even for rotary embeddings, got " +
                std::to_string(s.head_dim));
    if (s.head_dim > kMaxHeadDim)
        a.error("the head dimension " + std::to_string(s.head_dim) + " is larger than the " +
                std::to_string(kMaxHeadDim) + " supported");
    s.hidden = a.positive_int("hidden");
    s.eps = a.number("eps", 1e-6, 0.0, 1.0, false);
    s.qk_norm = a.boolean("qk_norm", false);
    s.attention_bias = a.boolean("attention_bias", false);
    s.mlp_bias = a.boolean("mlp_bias", false);
    s.init_std = a.number("init_std", 0.02, 0.0, 1e3, false);
    RopeSpec &r = s.rope;
    r.theta = a.number("rope_theta", 10000.0, 1e-9, 1e30, false);
    r.type = a.choice("rope_type", "default", {"default", "linear", "llama3"});
    r.factor = a.number("rope_factor", 1.0, 1e-9, 1e9, false);
    r.low_freq_factor = a.number("rope_low_freq_factor", 1.0, 1e-9, 1e9, false);
    r.high_freq_factor = a.number("rope_high_freq_factor", 4.0, 1e-9, 1e9, false);
    r.original_max_positions = a.has("rope_original_max_positions")
                                   ? a.positive_int("rope_original_max_positions")
                                   : r.original_max_positions;
    if (r.type == "llama3" && r.low_freq_factor == r.high_freq_factor)
        a.error("llama3 rope needs \"rope_low_freq_factor\" != \"rope_high_freq_factor\"");
    return s;
}

std::unique_ptr<Layer> build_layer(const std::string &type, LayerArgs &a) {
    if (type == "linear") {
        int64_t in = a.positive_int("in"), out = a.positive_int("out");
        return make_linear(in, out, a.boolean("bias", true));
    }
    if (type == "embedding") {
        int64_t num = a.positive_int("num"), dim = a.positive_int("dim");
        return make_embedding(num, dim);
    }
    if (type == "layer_norm") {
        int64_t dim = a.positive_int("dim");
        return make_layer_norm(dim, a.number("eps", 1e-5, 0.0, 1.0, false));
    }
    if (type == "rms_norm") {
        int64_t dim = a.positive_int("dim");
        return make_rms_norm(dim, a.number("eps", 1e-6, 0.0, 1.0, false));
    }
    if (type == "relu" || type == "silu" || type == "tanh")
        return make_activation(type);
    if (type == "gelu")
        return make_activation(a.choice("approximate", "none", {"none", "tanh"}) == "tanh"
                                   ? "gelu_tanh"
                                   : "gelu");
    if (type == "dropout")
        return make_dropout(a.number("p", 0.5, 0.0, 1.0, true));
    if (type == "residual_mlp") {
        int64_t dim = a.positive_int("dim"), hidden = a.positive_int("hidden");
        std::string act = a.choice("activation", "gelu", kActivations);
        std::string norm = a.choice("norm", "layer_norm", {"layer_norm", "rms_norm", "none"});
        return make_residual_mlp(dim, hidden, act, norm, a.number("eps", 1e-5, 0.0, 1.0, false));
    }
    if (type == "flatten")
        return make_flatten(a.integer("start_dim", 1));
    if (type == "token_embedding") {
        int64_t num = a.positive_int("num"), dim = a.positive_int("dim");
        return make_token_embedding(num, dim, a.number("init_std", 0.02, 0.0, 1e3, false));
    }
    if (type == "decoder_layer")
        return make_decoder_layer(decoder_spec(a));
    if (type == "lm_head") {
        int64_t dim = a.positive_int("dim"), vocab = a.positive_int("vocab");
        std::string tied_to = a.text("tied_to", "");
        double init_std = a.number("init_std", 0.02, 0.0, 1e3, false);
        int64_t chunk = a.integer("chunk_tokens", 0);
        if (chunk < 0)
            a.error("\"chunk_tokens\" must be >= 0 (0: automatic), got " + std::to_string(chunk));
        return make_lm_head(dim, vocab, tied_to, init_std, chunk);
    }
    if (type == "reshape")
        return make_reshape(a.shape("shape"));
    a.error("unknown layer type; known types: linear, embedding, layer_norm, rms_norm, relu, gelu, "
            "silu, tanh, dropout, residual_mlp, flatten, reshape, token_embedding, decoder_layer, "
            "lm_head");
}

} // namespace

std::vector<std::unique_ptr<Layer>> parse_model_spec(const std::string &json_text,
                                                     const CallerLayerSource &caller_layer,
                                                     size_t num_caller_layers) {
    json root;
    try {
        root = json::parse(json_text);
    } catch (const json::exception &e) { // syntax, and numbers out of range (1e400)
        fail(ErrorKind::InvalidArgument, std::string("model spec is not valid JSON: ") + e.what());
    }
    require(root.is_object() && root.contains("layers") && root["layers"].is_array(),
            "model spec must be an object with a \"layers\" array");
    for (auto it = root.begin(); it != root.end(); ++it)
        require(it.key() == "layers",
                "model spec: unknown top-level key \"" + it.key() + "\" (expected \"layers\")");
    const json &layers = root["layers"];
    require(!layers.empty(), "model spec: \"layers\" is empty");

    std::vector<std::unique_ptr<Layer>> out;
    std::vector<bool> used(num_caller_layers, false);
    for (size_t i = 0; i < layers.size(); ++i) {
        const json &entry = layers[i];
        std::string prefix = "layer " + std::to_string(i);
        require(entry.is_object(), prefix + ": must be an object, got " + entry.dump());
        require(entry.contains("type") && entry["type"].is_string(),
                prefix + ": missing \"type\" (a string)");
        std::string type = entry["type"].get<std::string>();
        LayerArgs args(entry, i, type);
        std::unique_ptr<Layer> layer;
        if (type == "caller") {
            // {"type": "caller", "def": k}: the caller's k-th declared layer, used once.
            int64_t k = args.integer("def", -1);
            if (k < 0 || static_cast<size_t>(k) >= num_caller_layers)
                args.error("\"def\" must be an index in [0, " +
                           std::to_string(num_caller_layers) + ") of the declared layers");
            if (used[static_cast<size_t>(k)])
                args.error("def " + std::to_string(k) + " is used by two entries");
            used[static_cast<size_t>(k)] = true;
            layer = caller_layer(static_cast<size_t>(k));
        } else {
            layer = build_layer(type, args);
        }
        args.finish();
        out.push_back(std::move(layer));
    }
    for (size_t k = 0; k < num_caller_layers; ++k)
        require(used[k], "model spec: declared layer " + std::to_string(k) +
                             " is not used by any {\"type\": \"caller\"} entry");
    return out;
}

} // namespace rp
