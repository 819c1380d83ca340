// CPU SGD with momentum over fp32 arrays, with torch.optim.SGD's arithmetic (L2 weight decay
// added to the gradient, dampening 0, the first step seeds the momentum buffer with the gradient).
#pragma once
#include <cstdint>

#include "optim/bf16_convert.h"

namespace rp {

struct SgdHyper {
    double lr, momentum, weight_decay;
};

// `momentum_buf` may be null when momentum is 0. `first_step` seeds the buffer.
void sgd_update(float *param, const float *grad, float *momentum_buf, int64_t n,
                const SgdHyper &h, bool first_step);

// The same update with the momentum buffer in bf16 (stochastically rounded) and the gradient in
// fp32 or bf16, each element in one pass. `step` and `param_index` seed the rounding.
// `live_bf16` (may be null) receives the updated weights rounded to bf16 and `zero_grad` zeroes
// the gradient, in the same pass over memory (publish_block): what memory-saving mode does after
// each update.
void sgd_update_bf16_state(float *param, const GradSpan &grad, uint16_t *momentum_buf, int64_t n,
                           const SgdHyper &h, bool first_step, int64_t step, uint64_t param_index,
                           uint16_t *live_bf16 = nullptr, bool zero_grad = false);

} // namespace rp
