// A linear projection of a decoder layer, y = x W^T (+ b), plus its LoRA adapter's term where it
// has one (src/layers/lora.h). It holds the indices of its tensors among the layer's parameters,
// so the dense and the mixture-of-experts decoder layers declare and apply projections alike.
#pragma once
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "engine/layer.h"
#include "layers/lora.h"

namespace rp {

class Projection {
  public:
    Projection() = default;
    // Appends to `params` the weight [out, in] (normal(0, init_std)), the bias [out] (zeros)
    // when `with_bias`, then the adapter's A and B where `lora` targets `t`: PEFT's order inside
    // the module. The names are lora_module_path(t) + ".weight", ".bias", ".lora_A.weight", ...
    Projection(std::vector<ParamSpec> &params, LoraTarget t, int64_t out, int64_t in,
               bool with_bias, double init_std, const LoraSpec &lora);

    // `p` holds the layer's parameters, in the order of its params().
    at::Tensor operator()(const at::Tensor &x, const std::vector<at::Tensor> &p,
                          const LoraSpec &lora, const LayerContext &ctx) const;

    // What the adapter keeps per token for backward (0 without one): A's output (r wide, kept
    // by B) and, with dropout, the dropped input and its mask (A's input).
    double adapter_bytes(double dtype_bytes, const LoraSpec &lora) const;

  private:
    LoraTarget target_ = LoraTarget::Q;
    int64_t in_ = 0;
    int weight_ = -1, bias_ = -1, lora_a_ = -1, lora_b_ = -1;
};

// With adapters, only they train: every other parameter of `params` becomes frozen (held once in
// the model dtype, no master, gradient or optimizer state).
void freeze_all_but_adapters(std::vector<ParamSpec> &params);

} // namespace rp
