#include "hf/hf_lora.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "base/progress.h"
#include "io/durable_file.h"

namespace rp {
namespace {

using json = nlohmann::json;

constexpr const char *kConfigFile = "adapter_config.json";
constexpr const char *kWeightsFile = "adapter_model.safetensors";
// PeftModel wraps the transformers model as base_model.model.
constexpr const char *kPeftPrefix = "base_model.model.";

[[noreturn]] void bad_adapter(const std::string &where, const std::string &what) {
    fail(ErrorKind::InvalidArgument, where + ": " + what);
}

std::string format_number(double v) {
    json j = v;
    return j.dump();
}

json adapter_config(const HfModelInfo &info, const std::string &base_model) {
    const LoraSpec &lora = info.lora;
    json config = {
        {"peft_type", "LORA"},
        {"task_type", "CAUSAL_LM"},
        {"base_model_name_or_path", base_model.empty() ? json(nullptr) : json(base_model)},
        {"r", lora.rank},
        {"lora_alpha", lora.alpha},
        {"lora_dropout", lora.dropout},
        {"target_modules", lora_target_names(lora.targets)},
        {"bias", "none"},
        {"fan_in_fan_out", false},
        {"use_rslora", false},
        {"use_dora", false},
        {"init_lora_weights", true},
        {"inference_mode", true},
        {"modules_to_save", nullptr},
        {"layers_to_transform", nullptr},
        {"layers_pattern", nullptr},
        {"rank_pattern", json::object()},
        {"alpha_pattern", json::object()},
    };
    return config;
}

// Checks that adapter_config.json describes the model's LoRA; the message names the key.
void check_adapter_config(const json &c, const LoraSpec &lora, const std::string &where) {
    if (!c.is_object())
        bad_adapter(where, "not a JSON object");
    auto value = [&](const char *key) -> const json * {
        auto it = c.find(key);
        return it == c.end() || it->is_null() ? nullptr : &*it;
    };
    const json *type = value("peft_type");
    if (!type || *type != "LORA")
        bad_adapter(where, "\"peft_type\" must be \"LORA\", got " +
                               (type ? type->dump() : std::string("nothing")));
    const json *r = value("r");
    if (!r || !r->is_number_integer() || r->get<int64_t>() != lora.rank)
        bad_adapter(where, "\"r\" is " + (r ? r->dump() : std::string("missing")) +
                               ", the model's LoRA rank is " + std::to_string(lora.rank));
    const json *alpha = value("lora_alpha");
    if (!alpha || !alpha->is_number() || std::fabs(alpha->get<double>() - lora.alpha) >
                                             1e-12 * std::max(1.0, std::fabs(lora.alpha)))
        bad_adapter(where, "\"lora_alpha\" is " + (alpha ? alpha->dump() : std::string("missing")) +
                               ", the model's is " + format_number(lora.alpha));
    const json *targets = value("target_modules");
    std::set<std::string> given;
    // PEFT matches targets by their last dotted component, and writes the module paths it
    // matched ("model.layers.0.self_attn.q_proj") when it was given "all-linear"; the tensor
    // check below then requires exactly the model's adapters, layer by layer.
    if (targets && targets->is_array())
        for (const json &t : *targets) {
            const std::string name = t.is_string() ? t.get<std::string>() : t.dump();
            given.insert(name.substr(name.find_last_of('.') + 1));
        }
    else if (targets && targets->is_string() && targets->get<std::string>() == "all-linear")
        given = {"all-linear"};
    const std::vector<std::string> names = lora_target_names(lora.targets);
    const std::set<std::string> expected(names.begin(), names.end());
    const bool all_linear = given == std::set<std::string>{"all-linear"} &&
                            lora.targets == (1u << kLoraTargets) - 1;
    if (given != expected && !all_linear)
        bad_adapter(where, "\"target_modules\" is " +
                               (targets ? targets->dump() : std::string("missing")) +
                               ", the model's adapters are on " + lora_targets_text(lora.targets));
    for (const char *key : {"use_dora", "use_rslora", "fan_in_fan_out"}) {
        const json *flag = value(key);
        if (flag && !(flag->is_boolean() && !flag->get<bool>()))
            bad_adapter(where, "\"" + std::string(key) + "\" is " + flag->dump() +
                                   "; RoundPipe's adapters are plain LoRA");
    }
    const json *bias = value("bias");
    if (bias && *bias != "none")
        bad_adapter(where, "\"bias\" is " + bias->dump() + "; only \"none\" is supported");
    for (const char *key : {"rank_pattern", "alpha_pattern"}) {
        const json *pattern = value(key);
        if (pattern && !(pattern->is_object() && pattern->empty()))
            bad_adapter(where, "\"" + std::string(key) +
                                   "\" is not empty; every adapter of a RoundPipe model has "
                                   "the same rank and alpha");
    }
    for (const char *key : {"layers_to_transform", "modules_to_save"}) {
        const json *v = value(key);
        if (v && !(v->is_array() && v->empty()))
            bad_adapter(where, "\"" + std::string(key) + "\" is " + v->dump() +
                                   "; RoundPipe adapts every decoder layer and trains nothing "
                                   "else");
    }
}

} // namespace

void save_lora_adapter(Model &model, const HfModelInfo &info, const std::string &dir,
                       const std::string &base_model) {
    require(info.lora.enabled(), "the model has no LoRA adapters (rp_model_options_set_lora)");
    model.synchronize();
    ensure_dir(dir);
    std::vector<NamedTensor> tensors;
    for (size_t i : info.adapter_params)
        tensors.push_back({kPeftPrefix + info.tensor_names[i], model.params().at(i).master});
    write_safetensors(path_join(dir, kWeightsFile), tensors, {{"format", "pt"}});
    const std::string config_path = path_join(dir, kConfigFile);
    remove_stale_temporaries(dir, [](const std::string &name) { return name == kConfigFile; });
    rename_into_place(stage_text_file(config_path, adapter_config(info, base_model).dump(2) + "\n"),
                      config_path);
    sync_dir(dir);
}

void load_lora_adapter(Model &model, const HfModelInfo &info, const std::string &dir) {
    require(info.lora.enabled(), "the model has no LoRA adapters (rp_model_options_set_lora)");
    const std::string config_path = path_join(dir, kConfigFile);
    json config;
    try {
        config = json::parse(read_text_file(config_path));
    } catch (const json::exception &e) {
        fail(ErrorKind::Io, config_path + ": not valid JSON (" + e.what() + ")");
    }
    check_adapter_config(config, info.lora, config_path);

    // Expected tensors by PEFT name; anything else in the file is refused by name.
    std::map<std::string, size_t> expected;
    for (size_t i : info.adapter_params)
        expected[kPeftPrefix + info.tensor_names[i]] = i;
    const std::string weights_path = path_join(dir, kWeightsFile);
    std::vector<NamedTensor> read = read_safetensors(
        weights_path, [&](const std::string &name, at::ScalarType type, at::IntArrayRef shape) {
            auto it = expected.find(name);
            if (it == expected.end())
                bad_adapter(weights_path,
                            "tensor \"" + name +
                                "\" is not an adapter of this model (its adapters are on " +
                                lora_targets_text(info.lora.targets) + " of " +
                                std::to_string(info.config.layers) + " decoder layers)");
            const at::Tensor &master = model.params().at(it->second).master;
            if (shape != master.sizes())
                bad_adapter(weights_path, "tensor \"" + name + "\" has shape " +
                                              c10::str(shape) + ", the model's adapter " +
                                              c10::str(master.sizes()));
            if (!at::isFloatingType(type))
                bad_adapter(weights_path, "tensor \"" + name + "\" is " + c10::toString(type) +
                                              ", not floating point");
            return true;
        });
    std::map<std::string, at::Tensor> by_name;
    for (NamedTensor &nt : read)
        by_name[nt.name] = nt.tensor;
    for (const auto &kv : expected)
        if (!by_name.count(kv.first))
            bad_adapter(weights_path, "tensor \"" + kv.first + "\" is missing");

    model.synchronize();
    {
        at::NoGradGuard no_grad;
        for (const auto &kv : expected)
            model.params().at(kv.second).master.copy_(by_name[kv.first]);
    }
    model.synchronize(); // publishes the new masters
    model.zero_grad();
}

} // namespace rp
