#include "optim/sgd_kernel.h"

#include <algorithm>

#include <ATen/Parallel.h>

#include "optim/bf16_convert.h"
#include "optim/parallel_blocks.h"

namespace rp {
namespace {

constexpr int64_t kGrain = 1 << 15;

// A momentum buffer element's value in fp32, and its store: fp32 as it is, bf16 rounded
// stochastically with the low half of `noise` (for fp32 the hash that makes it is dead code).
inline float state_value(float b) { return b; }
inline float state_value(uint16_t b) { return bf16_value(b); }
inline void store_state(float &b, float x, uint32_t) { b = x; }
inline void store_state(uint16_t &b, float x, uint32_t noise) {
    b = stochastic_bf16(x, noise & 0xFFFFU);
}
inline float grad_value(float g) { return g; }
inline float grad_value(uint16_t g) { return bf16_value(g); }

// torch.optim.SGD's three forms (no momentum; the first step seeding the buffer; later steps)
// over an fp32 or bf16 gradient and buffer, each element start to end in registers. A bf16
// buffer element is rounded with a hash of its index `first + i` in the parameter.
template <class Grad, class Buf>
__attribute__((always_inline)) inline void
sgd_loops(float *__restrict p, const Grad *__restrict g, Buf *__restrict buf, int64_t n, float lr,
          float momentum, float wd, bool first_step, uint32_t first, uint32_t salt) {
    auto noise = [&](int64_t i) {
        return rounding_hash((first + static_cast<uint32_t>(i)) ^ salt);
    };
    if (!buf) {
        for (int64_t i = 0; i < n; ++i)
            p[i] -= lr * (grad_value(g[i]) + wd * p[i]);
        return;
    }
    if (first_step) {
        for (int64_t i = 0; i < n; ++i) {
            float d = grad_value(g[i]) + wd * p[i];
            store_state(buf[i], d, noise(i));
            p[i] -= lr * d;
        }
        return;
    }
    for (int64_t i = 0; i < n; ++i) {
        float b = momentum * state_value(buf[i]) + (grad_value(g[i]) + wd * p[i]);
        store_state(buf[i], b, noise(i));
        p[i] -= lr * b;
    }
}

// The instances the updates use, each with AVX-512 and AVX2 bodies (see adamw_kernel.cpp).
__attribute__((target_clones("avx512f", "avx2", "default"))) void
sgd_range(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float wd,
          bool first_step) {
    sgd_loops(p, g, buf, n, lr, momentum, wd, first_step, 0, 0);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
sgd_bf16_state_f32_grad(float *p, const float *g, uint16_t *buf, int64_t n, float lr,
                        float momentum, float wd, bool first_step, uint32_t first, uint32_t salt) {
    sgd_loops(p, g, buf, n, lr, momentum, wd, first_step, first, salt);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
sgd_bf16_state_bf16_grad(float *p, const uint16_t *g, uint16_t *buf, int64_t n, float lr,
                         float momentum, float wd, bool first_step, uint32_t first, uint32_t salt) {
    sgd_loops(p, g, buf, n, lr, momentum, wd, first_step, first, salt);
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
