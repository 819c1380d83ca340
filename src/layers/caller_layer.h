// A caller-defined layer: its parameters and buffers are declared by the caller and owned by the
// engine like any layer's; its computation is the caller's callbacks (docs/semantics.md,
// "Caller-defined layers"). With gradients wanted, a call becomes one autograd node whose
// backward is the caller's backward, so caller layers mix freely with built-in ones in a stage.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "engine/caller_call.h"
#include "engine/layer.h"

namespace rp {

struct CallerCallbacks {
    // Returns the outputs (at least one). In the recompute and tail phases it may store a context
    // for backward in *context. Throws rp::Error on failure.
    std::function<std::vector<at::Tensor>(const CallerCall &call,
                                          const std::vector<at::Tensor> &inputs, void **context)>
        forward;
    // Fills one gradient per input and per parameter (undefined: none). Empty: the layer passes
    // no gradient.
    std::function<void(const CallerCall &call, void *context,
                       const std::vector<at::Tensor> &output_grads,
                       std::vector<at::Tensor> &input_grads, std::vector<at::Tensor> &param_grads)>
        backward;
    // Frees a stored context; empty when none is ever stored.
    std::function<void(void *context)> release;
};

class CallerLayer : public Layer {
  public:
    // `params` in declaration order, parameters and buffers interleaved as declared; `cost` and
    // `activation_bytes` (per token, in the model dtype) < 0: the default estimates.
    CallerLayer(std::string type_name, std::vector<ParamSpec> params, CallerCallbacks callbacks,
                double cost, double activation_bytes = -1.0);

    std::string type() const override { return type_; }
    at::Tensor forward(const std::vector<at::Tensor> &params, const at::Tensor &x,
                       const LayerContext &ctx) const override;
    std::vector<at::Tensor> forward_list(const std::vector<at::Tensor> &params,
                                         const std::vector<at::Tensor> &inputs,
                                         const LayerContext &ctx) const override;
    bool takes_all_call_inputs() const override { return true; }
    bool shape_checkable() const override { return false; }
    double cost_estimate() const override;
    double activation_bytes_per_token(double dtype_bytes) const override;

  private:
    std::string type_;
    CallerCallbacks callbacks_;
    double cost_;
    double activation_bytes_;
};

} // namespace rp
