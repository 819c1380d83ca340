// CPU AdamW over fp32 arrays, with torch.optim.AdamW's arithmetic (decoupled weight decay,
// bias correction), split across libtorch's intra-op threads and vectorised by the compiler.
#pragma once
#include <cstdint>

namespace rp {

struct AdamWHyper {
    double lr, beta1, beta2, eps, weight_decay;
};

// `step` is the 1-based number of this update (bias correction).
void adamw_update(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                  const AdamWHyper &h, int64_t step);

} // namespace rp
