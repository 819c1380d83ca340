// Losses of one microbatch and the backward pass that starts from them.
#pragma once
#include <functional>

#include <ATen/ATen.h>

namespace rp {

enum class LossKind { Output, Mse, CrossEntropy, Callback };

// Custom loss: given the outputs (fp32, CPU) and labels of microbatch `m`, returns the loss and
// fills `grad` with d(loss)/d(outputs). Throws rp::Error(Callback) on failure.
using LossCallback = std::function<double(const at::Tensor &outputs, const at::Tensor &labels,
                                          int microbatch, at::Tensor &grad)>;

struct Loss {
    LossKind kind = LossKind::Output;
    double scale = 1.0;
    LossCallback callback;
};

// Shape checks before a call runs, so bad labels fail before anything changes.
void check_loss_inputs(const Loss &loss, const at::Tensor &output, const at::Tensor &labels);

// Computes scale * L(output, labels) and back-propagates it through `output`'s graph.
// Returns the loss value.
double loss_backward(const Loss &loss, const at::Tensor &output, const at::Tensor &labels,
                     int microbatch);

} // namespace rp
