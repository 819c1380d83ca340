#include "layers/caller_layer.h"

#include <torch/csrc/autograd/custom_function.h>

#include "base/error.h"
#include "engine/cuda_memory.h"

namespace rp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One forward of a caller layer and the context it stored, until backward has run or the
// autograd graph holding it is freed (a failed call): either way the context is released once.
struct Invocation : torch::CustomClassHolder {
    const CallerCallbacks *callbacks = nullptr;
    std::string where; // "layer 3 (python:Block)", for messages
    CallerCall call;
    void *context = nullptr;
    std::vector<at::Tensor> inputs; // shapes, dtypes and devices for the gradient checks
    std::vector<bool> param_trainable;

    void release() {
        void *c = context;
        context = nullptr;
        if (c && callbacks->release)
            callbacks->release(c);
    }
    ~Invocation() override {
        try {
            release();
        } catch (...) {
        }
    }
};

[[noreturn]] void bad_callback(const std::string &where, const std::string &what) {
    fail(ErrorKind::Callback, where + ": " + what);
}

// A gradient from the caller for `like`: its shape, floating; returned in its dtype and device.
at::Tensor checked_grad(const std::string &where, const std::string &what, const at::Tensor &g,
                        const at::Tensor &like) {
    if (g.sizes() != like.sizes())
        bad_callback(where, "the gradient of " + what + " has shape " + c10::str(g.sizes()) +
                                ", expected " + c10::str(like.sizes()));
    if (!at::isFloatingType(g.scalar_type()))
        bad_callback(where, "the gradient of " + what + " is not floating point (" +
                                std::string(c10::toString(g.scalar_type())) + ")");
    return g.to(like.device(), like.scalar_type());
}

std::vector<at::Tensor> run_forward(Invocation &inv, const std::vector<at::Tensor> &inputs,
                                    void **context) {
    std::vector<at::Tensor> outputs;
    try {
        outputs = inv.callbacks->forward(inv.call, inputs, context);
    } catch (const Error &e) {
        fail(e.kind(), inv.where + ": " + e.what());
    }
    if (outputs.empty())
        bad_callback(inv.where, "the forward returned no output");
    for (size_t i = 0; i < outputs.size(); ++i) {
        if (!outputs[i].defined())
            bad_callback(inv.where, "output " + std::to_string(i) + " is missing (NULL)");
        if (outputs[i].device() != inv.call.device)
            outputs[i] = outputs[i].to(inv.call.device);
    }
    return outputs;
}

struct CallerFunction : public torch::autograd::Function<CallerFunction> {
    static variable_list forward(AutogradContext *ctx, c10::intrusive_ptr<Invocation> inv,
                                 at::TensorList inputs, at::TensorList params) {
        (void)params; // lent through inv->call; listed so that autograd routes their gradients
        ctx->set_materialize_grads(false); // an unused output's gradient reaches the caller as NULL
        std::vector<at::Tensor> outputs = run_forward(*inv, inputs.vec(), &inv->context);
        ctx->saved_data["invocation"] = at::IValue::make_capsule(inv);
        return outputs;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grad_outputs) {
        auto inv = c10::static_intrusive_pointer_cast<Invocation>(
            ctx->saved_data["invocation"].toCapsule());
        const std::string &where = inv->where;
        CallerCall call = inv->call;
        call.stream = call.device.is_cuda() ? current_cuda_stream(call.device.index()) : nullptr;
        std::vector<at::Tensor> input_grads, param_grads;
        try {
            inv->callbacks->backward(call, inv->context, grad_outputs, input_grads, param_grads);
        } catch (const Error &e) {
            inv->release();
            fail(e.kind(), where + ": " + e.what());
        }
        inv->release();
        const size_t n_params = inv->param_trainable.size();
        if (input_grads.size() != inv->inputs.size())
            bad_callback(where, "the backward returned " + std::to_string(input_grads.size()) +
                                    " input gradients for " + std::to_string(inv->inputs.size()) +
                                    " inputs");
        if (param_grads.size() != n_params)
            bad_callback(where, "the backward returned " + std::to_string(param_grads.size()) +
                                    " parameter gradients for " + std::to_string(n_params) +
                                    " parameters");
        variable_list result{at::Tensor()}; // the invocation argument has none
        for (size_t i = 0; i < input_grads.size(); ++i) {
            const at::Tensor &x = inv->inputs[i];
            if (input_grads[i].defined() && at::isFloatingType(x.scalar_type()))
                result.push_back(checked_grad(where, "input " + std::to_string(i),
                                              input_grads[i], x));
            else
                result.push_back(at::Tensor());
        }
        for (size_t i = 0; i < n_params; ++i) {
            if (!param_grads[i].defined()) {
                result.push_back(at::Tensor());
                continue;
            }
            if (!inv->param_trainable[i])
                bad_callback(where, "the backward returned a gradient for frozen parameter " +
                                        std::to_string(i));
            result.push_back(checked_grad(where, "parameter " + std::to_string(i), param_grads[i],
                                          inv->call.params[i]));
        }
        return result;
    }
};

} // namespace

CallerLayer::CallerLayer(std::string type_name, std::vector<ParamSpec> params,
                         CallerCallbacks callbacks, double cost, double activation_bytes)
    : type_(std::move(type_name)), callbacks_(std::move(callbacks)), cost_(cost),
      activation_bytes_(activation_bytes) {
    params_ = std::move(params);
}

double CallerLayer::cost_estimate() const { return cost_ >= 0 ? cost_ : Layer::cost_estimate(); }

double CallerLayer::activation_bytes_per_token(double dtype_bytes) const {
    return activation_bytes_ >= 0 ? activation_bytes_
                                  : Layer::activation_bytes_per_token(dtype_bytes);
}

at::Tensor CallerLayer::forward(const std::vector<at::Tensor> &params, const at::Tensor &x,
                                const LayerContext &ctx) const {
    return forward_list(params, {x}, ctx).at(0);
}

std::vector<at::Tensor> CallerLayer::forward_list(const std::vector<at::Tensor> &params,
                                                  const std::vector<at::Tensor> &inputs,
                                                  const LayerContext &ctx) const {
    auto inv = c10::make_intrusive<Invocation>();
    inv->callbacks = &callbacks_;
    inv->where = "layer " + std::to_string(ctx.layer_index) + " (" + type_ + ")";
    CallerCall &call = inv->call;
    call.phase = ctx.phase;
    call.device = ctx.device;
    call.stream = ctx.device.is_cuda() ? current_cuda_stream(ctx.device.index()) : nullptr;
    call.seed = ctx.dropout_seed;
    call.microbatch = ctx.microbatch;
    call.training = ctx.training;
    // Parameters are lent without their autograd identity (the engine's leaves stay the
    // engine's); buffers as the device tensors themselves, which forward passes update in place.
    std::vector<at::Tensor> param_tensors;
    bool wants_grad = false;
    for (size_t i = 0; i < params_.size(); ++i) {
        if (params_[i].role == ParamRole::Buffer) {
            call.buffers.push_back(params[i]);
            continue;
        }
        call.params.push_back(params[i].detach());
        // A tied parameter is trainable when the parameter it shares is (its tensor says so).
        const bool tied = !params_[i].tied_to.empty();
        inv->param_trainable.push_back(params_[i].role == ParamRole::Trainable &&
                                       (!tied || params[i].requires_grad()));
        param_tensors.push_back(params[i]);
        wants_grad = wants_grad || params[i].requires_grad();
    }
    for (const at::Tensor &x : inputs) {
        if (!x.defined())
            fail(ErrorKind::Internal, inv->where + ": an input is missing");
        wants_grad = wants_grad || x.requires_grad();
    }
    const bool graph = at::GradMode::is_enabled() && ctx.phase != Phase::Forward &&
                       wants_grad && callbacks_.backward;
    if (!graph) {
        // No backward will follow (a forward stage, the first pass of a layer-grain recompute,
        // or nothing needs a gradient): a stored context is released at once.
        std::vector<at::Tensor> detached_inputs;
        for (const at::Tensor &x : inputs)
            detached_inputs.push_back(x.detach());
        std::vector<at::Tensor> out = run_forward(*inv, detached_inputs, &inv->context);
        inv->release();
        return out;
    }
    for (const at::Tensor &x : inputs)
        inv->inputs.push_back(x.detach());
    return CallerFunction::apply(inv, at::TensorList(inputs), at::TensorList(param_tensors));
}

} // namespace rp
