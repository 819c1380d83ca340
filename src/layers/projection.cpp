#include "layers/projection.h"

#include <string>

#include "layers/transformer_layers.h" // normal_param

namespace rp {

Projection::Projection(std::vector<ParamSpec> &params, LoraTarget t, int64_t out, int64_t in,
                       bool with_bias, double init_std, const LoraSpec &lora)
    : target_(t), in_(in) {
    auto add = [&params](ParamSpec p) {
        params.push_back(std::move(p));
        return static_cast<int>(params.size() - 1);
    };
    const std::string path = lora_module_path(t);
    weight_ = add(normal_param(path + ".weight", {out, in}, init_std));
    if (with_bias)
        bias_ = add({path + ".bias", {out}, InitKind::Zeros, 0.0});
    if (lora.enabled() && lora.targets_projection(t)) {
        lora_a_ = add(lora_a_param(t, lora.rank, in));
        lora_b_ = add(lora_b_param(t, lora.rank, out));
    }
}

at::Tensor Projection::operator()(const at::Tensor &x, const std::vector<at::Tensor> &p,
                                  const LoraSpec &lora, const LayerContext &ctx) const {
    at::Tensor y = bias_ >= 0 ? at::linear(x, p[weight_], p[bias_]) : at::linear(x, p[weight_]);
    if (lora_a_ < 0)
        return y;
    return y + lora_delta(x, p[lora_a_], p[lora_b_], lora, target_, ctx);
}

double Projection::adapter_bytes(double e, const LoraSpec &lora) const {
    if (lora_a_ < 0)
        return 0.0;
    return e * static_cast<double>(lora.rank) +
           (lora.dropout > 0 ? 2.0 * e * static_cast<double>(in_) : 0.0);
}

void freeze_all_but_adapters(std::vector<ParamSpec> &params) {
    for (ParamSpec &spec : params)
        if (!is_lora_adapter(spec.name))
            spec.role = ParamRole::Frozen;
}

} // namespace rp
