// Losses of one microbatch and the backward pass that starts from them.
#pragma once
#include <functional>

#include <ATen/ATen.h>

#include "engine/caller_call.h"

namespace rp {

// CausalLm: the model's last layer (lm_head) fuses the loss and outputs the sum of its token
// losses; the caller folds 1 / (targets of the whole call) into `scale`, so the sum over
// microbatches is the batch mean (causal_lm_target_count).
enum class LossKind { Output, Mse, CrossEntropy, Callback, CausalLm, DeviceCallback };

// Custom loss: given the outputs (fp32, CPU) and labels of microbatch `m`, returns the loss and
// fills `grad` with d(loss)/d(outputs). Throws rp::Error(Callback) on failure.
using LossCallback = std::function<double(const at::Tensor &outputs, const at::Tensor &labels,
                                          int microbatch, at::Tensor &grad)>;

// Custom loss on the device: given one microbatch's outputs (on the tail device, model dtype)
// and labels, returns the loss (one element, any float dtype, device or CPU) and fills `grads`
// with d(loss)/d(output) per output (undefined: none). Throws rp::Error(Callback) on failure.
using DeviceLossCallback =
    std::function<at::Tensor(const CallerCall &call, const std::vector<at::Tensor> &outputs,
                             const at::Tensor &labels, std::vector<at::Tensor> &grads)>;

struct Loss {
    LossKind kind = LossKind::Output;
    double scale = 1.0;
    LossCallback callback;
    DeviceLossCallback device_callback;
};

// Where a microbatch's loss is computed.
struct LossSite {
    at::Device device = at::Device(at::kCPU);
    int microbatch = 0;
};

// Shape checks before a call runs, so bad labels fail before anything changes.
void check_loss_inputs(const Loss &loss, const at::Tensor &output, const at::Tensor &labels);

// Number of tokens with a target in causal-LM labels [batch, seq]: labels[:, 1:] != -100.
int64_t causal_lm_target_count(const at::Tensor &labels);

// Computes scale * L(outputs, labels) and back-propagates it through the outputs' graph. Built-in
// losses read output 0. Returns the loss as a detached 0-d tensor, left on the device so no host
// sync happens here.
at::Tensor loss_backward(const Loss &loss, const std::vector<at::Tensor> &outputs,
                         const at::Tensor &labels, const LossSite &site);

} // namespace rp
