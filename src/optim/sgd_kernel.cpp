#include "optim/sgd_kernel.h"

#include <algorithm>

#include <ATen/Parallel.h>

#include "optim/bf16_convert.h"
#include "optim/parallel_blocks.h"

namespace rp {
namespace {

constexpr int64_t kGrain = 1 << 15;

__attribute__((target_clones("avx512f", "avx2", "default"))) void
sgd_range(float *__restrict p, const float *__restrict g, float *__restrict buf, int64_t n,
          float lr, float momentum, float wd, bool first_step) {
    if (!buf) {
        for (int64_t i = 0; i < n; ++i)
            p[i] -= lr * (g[i] + wd * p[i]);
        return;
    }
    if (first_step) {
        for (int64_t i = 0; i < n; ++i) {
            float d = g[i] + wd * p[i];
            buf[i] = d;
            p[i] -= lr * d;
        }
        return;
    }
    for (int64_t i = 0; i < n; ++i) {
        float b = momentum * buf[i] + (g[i] + wd * p[i]);
        buf[i] = b;
        p[i] -= lr * b;
    }
}

} // namespace

void sgd_update(float *param, const float *grad, float *momentum_buf, int64_t n, const SgdHyper &h,
                bool first_step) {
    optimizer_parallel_for(0, n, kOptimizerBlock, kGrain, [&](int64_t begin, int64_t end) {
        sgd_range(param + begin, grad + begin, momentum_buf ? momentum_buf + begin : nullptr,
                  end - begin, static_cast<float>(h.lr), static_cast<float>(h.momentum),
                  static_cast<float>(h.weight_decay), first_step);
    });
}

void sgd_update_bf16_state(float *param, const GradSpan &grad, uint16_t *momentum_buf, int64_t n,
                           const SgdHyper &h, bool first_step, int64_t step, uint64_t param_index) {
    const uint32_t salt = rounding_salt(step, param_index, 2);
    optimizer_parallel_for(0, n, kOptimizerBlock, kGrain, [&](int64_t begin, int64_t end) {
        float g[kBf16Block], buf[kBf16Block];
        for (int64_t b = begin; b < end; b += kBf16Block) {
            const int64_t len = std::min(kBf16Block, end - b);
            const float *gb = grad.f32 ? grad.f32 + b : g;
            if (!grad.f32)
                widen_bf16(grad.bf16 + b, g, len);
            if (momentum_buf)
                widen_bf16(momentum_buf + b, buf, len);
            sgd_range(param + b, gb, momentum_buf ? buf : nullptr, len, static_cast<float>(h.lr),
                      static_cast<float>(h.momentum), static_cast<float>(h.weight_decay),
                      first_step);
            if (momentum_buf)
                narrow_bf16_stochastic(buf, momentum_buf + b, len, b, salt);
        }
    });
}

} // namespace rp
