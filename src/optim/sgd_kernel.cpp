#include "optim/sgd_kernel.h"

#include <algorithm>
#include <cstring>

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

// The gradient's value in fp32: as it is, or a bf16 one widened (exactly).
inline float widened(float g) { return g; }
inline float widened(uint16_t g) {
    const uint32_t bits = static_cast<uint32_t>(g) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

// sgd_range's three forms over a bf16 momentum buffer, each element start to end in registers:
// the buffer widened, sgd_range's expressions (so its bits), the buffer rounded back
// stochastically from the low half of one hash of the element's index `first + i`.
template <class Grad>
__attribute__((always_inline)) inline void
sgd_bf16_state_loops(float *__restrict p, const Grad *__restrict g, uint16_t *__restrict buf,
                     int64_t n, float lr, float momentum, float wd, bool first_step, uint32_t first,
                     uint32_t salt) {
    auto rounded = [&](float x, int64_t i) {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        const uint32_t noise = rounding_hash((first + static_cast<uint32_t>(i)) ^ salt);
        return stochastic_bf16(bits, noise & 0xFFFFU);
    };
    if (!buf) {
        for (int64_t i = 0; i < n; ++i)
            p[i] -= lr * (widened(g[i]) + wd * p[i]);
        return;
    }
    if (first_step) {
        for (int64_t i = 0; i < n; ++i) {
            float d = widened(g[i]) + wd * p[i];
            buf[i] = rounded(d, i);
            p[i] -= lr * d;
        }
        return;
    }
    for (int64_t i = 0; i < n; ++i) {
        float b = momentum * widened(buf[i]) + (widened(g[i]) + wd * p[i]);
        buf[i] = rounded(b, i);
        p[i] -= lr * b;
    }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
sgd_bf16_state_f32_grad(float *p, const float *g, uint16_t *buf, int64_t n, float lr,
                        float momentum, float wd, bool first_step, uint32_t first, uint32_t salt) {
    sgd_bf16_state_loops(p, g, buf, n, lr, momentum, wd, first_step, first, salt);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
sgd_bf16_state_bf16_grad(float *p, const uint16_t *g, uint16_t *buf, int64_t n, float lr,
                         float momentum, float wd, bool first_step, uint32_t first, uint32_t salt) {
    sgd_bf16_state_loops(p, g, buf, n, lr, momentum, wd, first_step, first, salt);
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
                           const SgdHyper &h, bool first_step, int64_t step, uint64_t param_index,
                           uint16_t *live_bf16, bool zero_grad) {
    const uint32_t salt = rounding_salt(step, param_index, 2);
    const float lr = static_cast<float>(h.lr), momentum = static_cast<float>(h.momentum),
                wd = static_cast<float>(h.weight_decay);
    optimizer_parallel_for(0, n, kOptimizerBlock, kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; b += kBf16Block) {
            const int64_t len = std::min(kBf16Block, end - b);
            uint16_t *buf = momentum_buf ? momentum_buf + b : nullptr;
            const uint32_t first = static_cast<uint32_t>(b); // the rounding's index, as uint32
            if (grad.f32)
                sgd_bf16_state_f32_grad(param + b, grad.f32 + b, buf, len, lr, momentum, wd,
                                        first_step, first, salt);
            else
                sgd_bf16_state_bf16_grad(param + b, grad.bf16 + b, buf, len, lr, momentum, wd,
                                         first_step, first, salt);
            publish_block(param, live_bf16, grad, b, len, zero_grad);
        }
    });
}

} // namespace rp
