#include "engine/loss.h"

#include "base/error.h"
#include "engine/cuda_memory.h"

namespace rp {
namespace {

std::string shape_str(at::IntArrayRef s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i)
        out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
}

} // namespace

void check_loss_inputs(const Loss &loss, const at::Tensor &output, const at::Tensor &labels) {
    switch (loss.kind) {
    case LossKind::Output:
        // Shape checks run on an empty batch, whose output says nothing about the element count
        // of a real one; loss_backward checks those outputs again.
        if (output.dim() > 0 && output.size(0) == 0)
            break;
        require(output.numel() == 1, "the output loss needs a model output with one element, "
                                     "got shape " + shape_str(output.sizes()));
        break;
    case LossKind::Mse:
        require(labels.defined(), "the mean-squared-error loss needs labels");
        require(at::isFloatingType(labels.scalar_type()),
                "the mean-squared-error loss needs floating-point labels");
        require(labels.sizes() == output.sizes(),
                "labels of shape " + shape_str(labels.sizes()) +
                    " do not match the model output of shape " + shape_str(output.sizes()) +
                    " (per microbatch)");
        break;
    case LossKind::CrossEntropy:
        require(labels.defined(), "the cross-entropy loss needs labels");
        require(output.dim() == 2, "the cross-entropy loss needs outputs [N, C], got " +
                                       shape_str(output.sizes()));
        require(labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                    labels.size(0) == output.size(0),
                "the cross-entropy loss needs int64 labels [N] with N = " +
                    std::to_string(output.size(0)) + ", got " + shape_str(labels.sizes()));
        break;
    case LossKind::CausalLm:
        require(labels.defined(), "the causal-LM loss needs labels (token ids, -100 for none)");
        require(!at::isFloatingType(labels.scalar_type()),
                "the causal-LM loss needs integer labels (token ids, -100 for none)");
        // On the empty batch of the shape check the last layer has no labels and gives logits.
        if (output.dim() > 0 && output.size(0) == 0)
            break;
        require(output.numel() == 1,
                "the causal-LM loss needs a model whose last layer is an lm_head (it returns "
                "the summed token loss when given labels); got an output of shape " +
                    shape_str(output.sizes()));
        break;
    case LossKind::Callback:
    case LossKind::DeviceCallback:
        break;
    }
}

int64_t causal_lm_target_count(const at::Tensor &labels) {
    require(labels.dim() == 2, "causal-LM labels must be [batch, seq], got " +
                                   shape_str(labels.sizes()));
    if (labels.size(1) < 2)
        return 0;
    return labels.narrow(1, 1, labels.size(1) - 1).ne(-100).sum().item<int64_t>();
}

namespace {

// The device callback's answer, checked: one gradient per output, of its shape; the loss one
// element. Gradients in the output's device and dtype, times the loss scale.
at::Tensor device_loss_backward(const Loss &loss, const std::vector<at::Tensor> &outputs,
                                const at::Tensor &labels, const LossSite &site) {
    CallerCall call;
    call.phase = Phase::Tail;
    call.device = site.device;
    call.stream = site.device.is_cuda() ? current_cuda_stream(site.device.index()) : nullptr;
    call.microbatch = static_cast<size_t>(site.microbatch);
    call.training = true;
    std::vector<at::Tensor> detached;
    for (const at::Tensor &y : outputs)
        detached.push_back(y.defined() ? y.detach() : y);
    std::vector<at::Tensor> grads;
    at::Tensor value = loss.device_callback(call, detached, labels, grads);
    auto bad = [](const std::string &what) { fail(ErrorKind::Callback, "loss callback: " + what); };
    if (!value.defined() || value.numel() != 1 || !at::isFloatingType(value.scalar_type()))
        bad("the loss must be one floating-point element");
    if (grads.size() != outputs.size())
        bad("returned " + std::to_string(grads.size()) + " gradients for " +
            std::to_string(outputs.size()) + " outputs");
    std::vector<at::Tensor> roots, seeds;
    for (size_t i = 0; i < outputs.size(); ++i) {
        if (!grads[i].defined())
            continue;
        if (grads[i].sizes() != outputs[i].sizes())
            bad("the gradient of output " + std::to_string(i) + " has shape " +
                shape_str(grads[i].sizes()) + ", the output " + shape_str(outputs[i].sizes()));
        if (!at::isFloatingType(grads[i].scalar_type()))
            bad("the gradient of output " + std::to_string(i) + " is not floating point");
        if (!outputs[i].requires_grad())
            continue;
        roots.push_back(outputs[i]);
        seeds.push_back(grads[i].to(outputs[i].device(), outputs[i].scalar_type()) * loss.scale);
    }
    if (!roots.empty())
        torch::autograd::backward(roots, seeds);
    return (value.detach().reshape({}).to(site.device, at::kDouble) * loss.scale);
}

} // namespace

at::Tensor loss_backward(const Loss &loss, const std::vector<at::Tensor> &outputs,
                         const at::Tensor &labels, const LossSite &site) {
    if (loss.kind == LossKind::DeviceCallback)
        return device_loss_backward(loss, outputs, labels, site);
    require(!outputs.empty() && outputs[0].defined(), "the model gave no output for the loss");
    const at::Tensor &output = outputs[0];
    if (loss.kind == LossKind::Callback) {
        require(outputs.size() == 1,
                "a host loss callback takes one model output; this model gives " +
                    std::to_string(outputs.size()) + " (use a device loss callback)");
        at::Tensor out_cpu = output.detach().to(at::kCPU, at::kFloat).contiguous();
        at::Tensor grad;
        at::Tensor labels_cpu = labels.defined() ? labels.to(at::kCPU) : labels;
        double value = loss.callback(out_cpu, labels_cpu, site.microbatch, grad);
        require(grad.defined() && grad.sizes() == output.sizes(),
                "loss callback returned a gradient of shape " +
                    (grad.defined() ? shape_str(grad.sizes()) : std::string("(none)")) +
                    ", expected the output shape " + shape_str(output.sizes()));
        require(at::isFloatingType(grad.scalar_type()),
                "loss callback returned a gradient that is not floating point");
        at::Tensor g = grad.to(output.device(), output.scalar_type()) * loss.scale;
        torch::autograd::backward({output}, {g});
        return at::scalar_tensor(value * loss.scale, at::TensorOptions().dtype(at::kDouble));
    }
    at::Tensor out = output.to(at::kFloat);
    at::Tensor value;
    switch (loss.kind) {
    case LossKind::Output:
    case LossKind::CausalLm:
        check_loss_inputs(loss, output, labels);
        value = out.reshape({});
        break;
    case LossKind::Mse:
        value = at::mse_loss(out, labels.to(out.device(), at::kFloat));
        break;
    case LossKind::CrossEntropy:
        value = at::cross_entropy_loss(out, labels.to(out.device()));
        break;
    case LossKind::Callback:
    case LossKind::DeviceCallback:
        break;
    }
    value = value * loss.scale;
    torch::autograd::backward({value});
    return value.detach();
}

} // namespace rp
