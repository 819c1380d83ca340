#include "layers/spec_parser.h"

#include <cmath>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "layers/builtin_layers.h"

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
    if (type == "reshape")
        return make_reshape(a.shape("shape"));
    a.error("unknown layer type; known types: linear, embedding, layer_norm, rms_norm, relu, gelu, "
            "silu, tanh, dropout, residual_mlp, flatten, reshape");
}

} // namespace

std::vector<std::unique_ptr<Layer>> parse_model_spec(const std::string &json_text) {
    json root;
    try {
        root = json::parse(json_text);
    } catch (const json::parse_error &e) {
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
    for (size_t i = 0; i < layers.size(); ++i) {
        const json &entry = layers[i];
        std::string prefix = "layer " + std::to_string(i);
        require(entry.is_object(), prefix + ": must be an object, got " + entry.dump());
        require(entry.contains("type") && entry["type"].is_string(),
                prefix + ": missing \"type\" (a string)");
        std::string type = entry["type"].get<std::string>();
        LayerArgs args(entry, i, type);
        std::unique_ptr<Layer> layer = build_layer(type, args);
        args.finish();
        out.push_back(std::move(layer));
    }
    return out;
}

} // namespace rp
