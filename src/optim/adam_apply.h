// One stateless Adam / AdamW update over tensors someone else owns (rp_adam_apply): the caller
// keeps the moments and step counts, the engine's kernel does the arithmetic.
#pragma once
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "optim/adamw_kernel.h"

namespace rp {

// One parameter's tensors: the weight and both moments are updated in place, the gradient is
// read. `step` is the 1-based number of this update (bias correction).
struct AdamTensors {
    at::Tensor param, grad, exp_avg, exp_avg_sq;
    int64_t step = 0;
};

// Checks every entry (float32, host memory, contiguous, equal shapes, step >= 1, no tensor that
// is written overlapping another tensor of the call) and the hyperparameters (torch.optim.Adam's
// ranges) before touching anything, then updates the entries in order with the engine's kernel:
// decoupled weight decay (AdamW) or L2 (Adam). Throws InvalidArgument naming the entry.
void adam_apply(const std::vector<AdamTensors> &entries, const AdamWHyper &h, bool decoupled);

} // namespace rp
