#include "layers/lora.h"

#include <cmath>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include "base/error.h"
#include "engine/seed.h"

namespace rp {
namespace {

const char *const kNames[kLoraTargets] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                          "gate_proj", "up_proj", "down_proj"};

std::string trim(const std::string &s) {
    const size_t begin = s.find_first_not_of(" \t");
    const size_t end = s.find_last_not_of(" \t");
    return begin == std::string::npos ? std::string() : s.substr(begin, end - begin + 1);
}

} // namespace

const char *lora_target_name(LoraTarget t) { return kNames[static_cast<int>(t)]; }

std::string lora_module_path(LoraTarget t) {
    return std::string(t <= LoraTarget::O ? "self_attn." : "mlp.") + lora_target_name(t);
}

unsigned parse_lora_targets(const char *text) {
    const std::string all = text ? trim(text) : std::string();
    if (all.empty())
        return (1u << static_cast<int>(LoraTarget::Q)) | (1u << static_cast<int>(LoraTarget::V));
    if (all == "all-linear")
        return (1u << kLoraTargets) - 1;
    unsigned targets = 0;
    size_t start = 0;
    while (start <= all.size()) {
        const size_t comma = std::min(all.find(',', start), all.size());
        const std::string name = trim(all.substr(start, comma - start));
        int found = -1;
        for (int i = 0; i < kLoraTargets; ++i)
            if (name == kNames[i])
                found = i;
        if (found < 0)
            fail(ErrorKind::InvalidArgument,
                 "LoRA target module \"" + name +
                     "\" is not a projection of a decoder layer; adapters exist for " +
                     lora_targets_text((1u << kLoraTargets) - 1) + " (or \"all-linear\")");
        targets |= 1u << found;
        start = comma + 1;
    }
    return targets;
}

std::vector<std::string> lora_target_names(unsigned targets) {
    std::vector<std::string> names;
    for (int i = 0; i < kLoraTargets; ++i)
        if (targets & (1u << i))
            names.emplace_back(kNames[i]);
    return names;
}

std::string lora_targets_text(unsigned targets) {
    std::string text;
    for (const std::string &name : lora_target_names(targets))
        text += (text.empty() ? "" : ",") + name;
    return text;
}

void check_lora_spec(const LoraSpec &spec) {
    require(spec.rank > 0 && spec.rank <= 65536,
                "LoRA rank must be in 1 .. 65536, got " + std::to_string(spec.rank));
    require(std::isfinite(spec.alpha) && spec.alpha > 0,
                "LoRA alpha must be finite and > 0, got " + std::to_string(spec.alpha));
    require(spec.dropout >= 0 && spec.dropout < 1,
                "LoRA dropout must be in [0, 1), got " + std::to_string(spec.dropout));
    require(spec.targets != 0 && spec.targets < (1u << kLoraTargets),
                "LoRA needs at least one target module");
}

ParamSpec lora_a_param(LoraTarget t, int64_t rank, int64_t in) {
    // kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / in).
    return {lora_module_path(t) + ".lora_A.weight", {rank, in}, InitKind::Uniform,
            1.0 / std::sqrt(static_cast<double>(in))};
}

ParamSpec lora_b_param(LoraTarget t, int64_t rank, int64_t out) {
    return {lora_module_path(t) + ".lora_B.weight", {out, rank}, InitKind::Zeros, 0.0};
}

bool is_lora_adapter(const std::string &param_name) {
    return param_name.find(".lora_A.") != std::string::npos ||
           param_name.find(".lora_B.") != std::string::npos;
}

at::Tensor lora_delta(const at::Tensor &x, const at::Tensor &a, const at::Tensor &b,
                      const LoraSpec &spec, LoraTarget t, const LayerContext &ctx) {
    // The scalars (alpha / r, and dropout's 1 / (1 - p)) multiply A's output, r wide, instead
    // of the input or the output (dim wide): the same product to rounding, a sliver of the work.
    double scale = spec.scaling();
    at::Tensor in = x;
    if (ctx.training && spec.dropout > 0) {
        const uint64_t seed = mix(ctx.dropout_seed ^ (0x10000ULL + static_cast<uint64_t>(t)));
        at::Generator gen =
            x.is_cuda() ? at::detail::getCUDAHooks().getNewGenerator(x.device().index())
                        : at::make_generator<at::CPUGeneratorImpl>(seed);
        if (x.is_cuda())
            gen.set_current_seed(seed);
        in = x * at::empty_like(x).bernoulli_(1.0 - spec.dropout, gen);
        scale /= 1.0 - spec.dropout;
    }
    return at::linear(at::linear(in, a) * scale, b);
}

} // namespace rp
