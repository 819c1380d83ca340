#include "optim/adamw_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <ATen/Parallel.h>

#include "optim/bf16_convert.h"
#include "optim/parallel_blocks.h"

namespace rp {
namespace {

// Big enough that a thread's share amortises the fork; small enough to split 1e6 elements.
constexpr int64_t kGrain = 1 << 15;

struct AdamWConstants {
    float decay, one_minus_b1, b2, one_minus_b2, inv_bc2_sqrt, eps, step_size;
};

// AdamW's arithmetic on one element, in fp32 (the one home of these expressions: the fp32 loop
// and the memory-saving one both inline it, so they give the same bits).
__attribute__((always_inline)) inline void adamw_element(float &p, float g, float &m, float &v,
                                                         const AdamWConstants &c) {
    m = m + (g - m) * c.one_minus_b1; // torch: exp_avg.lerp_(grad, 1 - beta1)
    v = v * c.b2 + c.one_minus_b2 * g * g;
    const float denom = std::sqrt(v) * c.inv_bc2_sqrt + c.eps;
    p = p * c.decay - c.step_size * m / denom;
}

// target_clones gives AVX-512 and AVX2 bodies with a run-time dispatch, so one binary uses the
// widest vectors the host has. The loop is written so GCC vectorises it (no aliasing, no
// branches; the file is built with -O3 -fno-math-errno so sqrt vectorises too).
__attribute__((target_clones("avx512f", "avx2", "default"))) void
adamw_range(float *__restrict p, const float *__restrict g, float *__restrict m,
            float *__restrict v, int64_t n, AdamWConstants c) {
    for (int64_t i = 0; i < n; ++i)
        adamw_element(p[i], g[i], m[i], v[i], c);
}

// The same loop for L2 weight decay (torch.optim.Adam's default): the decay goes into the
// gradient and `c.decay` must be 1. A loop of its own, not an `l2 * p[i]` term in the one above:
// with l2 = 0 that term would still turn an inf weight into nan in AdamW's moments.
__attribute__((target_clones("avx512f", "avx2", "default"))) void
adam_l2_range(float *__restrict p, const float *__restrict g, float *__restrict m,
              float *__restrict v, int64_t n, float l2, AdamWConstants c) {
    for (int64_t i = 0; i < n; ++i) // torch: grad = grad.add(param, alpha=weight_decay)
        adamw_element(p[i], g[i] + l2 * p[i], m[i], v[i], c);
}

AdamWConstants constants(const AdamWHyper &h, int64_t step) {
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
    return {static_cast<float>(1.0 - h.lr * h.weight_decay),
            static_cast<float>(1.0 - h.beta1),
            static_cast<float>(h.beta2),
            static_cast<float>(1.0 - h.beta2),
            static_cast<float>(1.0 / std::sqrt(bc2)),
            static_cast<float>(h.eps),
            static_cast<float>(h.lr / bc1)};
}

// The gradient of elements [b, b + len) into `g` from a lent bf16 gradient with rows added in
// fp32 (GradSpan): every element widened, then the marked rows' fp32 sums added (f32 + bf16, the
// order ParamStore::materialize_grad adds in, so both give the same bits) and zeroed behind (the
// buffer a step leaves must be zero).
void gather_split_gradient(const GradSpan &grad, int64_t b, int64_t len, float *g) {
    widen_bf16(grad.bf16 + b, g, len);
    const int64_t w = grad.row_width;
    for (int64_t r = b / w; r * w < b + len; ++r) {
        if (!grad.f32_rows[r])
            continue;
        const int64_t from = std::max(b, r * w), to = std::min(b + len, (r + 1) * w);
        for (int64_t j = from; j < to; ++j)
            g[j - b] = grad.f32[j] + g[j - b];
        std::memset(grad.f32 + from, 0, sizeof(float) * (to - from));
    }
}

} // namespace

void adamw_update(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                  const AdamWHyper &h, int64_t step) {
    const AdamWConstants c = constants(h, step);
    optimizer_parallel_for(0, n, kOptimizerBlock, kGrain, [&](int64_t begin, int64_t end) {
        adamw_range(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin, end - begin,
                    c);
    });
}

void adamw_update_publish(float *param, const GradSpan &grad, float *exp_avg, float *exp_avg_sq,
                          int64_t n, const AdamWHyper &h, int64_t step, uint16_t *live_bf16,
                          WeightStores stores) {
    const AdamWConstants c = constants(h, step);
    const auto narrow =
        stores == WeightStores::Streaming ? narrow_bf16_nearest_streaming : narrow_bf16_nearest;
    optimizer_parallel_for(0, n, kOptimizerBlock, kGrain, [&](int64_t begin, int64_t end) {
        float g[kBf16Block];
        const bool fp32 = !grad.bf16; // else lent bf16, with or without rows in fp32
        for (int64_t b = begin; b < end; b += kBf16Block) {
            const int64_t len = std::min(kBf16Block, end - b);
            const float *gb = fp32 ? grad.f32 + b : g;
            if (grad.f32_rows)
                gather_split_gradient(grad, b, len, g);
            else if (!fp32)
                widen_bf16(grad.bf16 + b, g, len);
            adamw_range(param + b, gb, exp_avg + b, exp_avg_sq + b, len, c);
            narrow(param + b, live_bf16 + b, len);
            if (fp32)
                std::memset(grad.f32 + b, 0, sizeof(float) * len);
        }
    });
}

void adam_l2_update(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                    const AdamWHyper &h, int64_t step) {
    AdamWConstants c = constants(h, step);
    c.decay = 1.0f; // p * 1 is p: the weight is decayed through the gradient instead
    const float l2 = static_cast<float>(h.weight_decay);
    optimizer_parallel_for(0, n, kOptimizerBlock, kGrain, [&](int64_t begin, int64_t end) {
        adam_l2_range(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin, end - begin,
                      l2, c);
    });
}

namespace {

// One element of the memory-saving update, start to end in registers: the moments widened from
// bf16, adamw_element's arithmetic, the moments rounded back stochastically from one hash of the
// element's index (its low half for exp_avg, its high half for exp_avg_sq). Inlined into the
// loops below, which the compiler vectorises.
__attribute__((always_inline)) inline void bf16_state_element(float &p, float g, uint16_t &m16,
                                                              uint16_t &v16, uint32_t index,
                                                              const AdamWConstants &c,
                                                              uint32_t salt) {
    float m = bf16_value(m16), v = bf16_value(v16);
    adamw_element(p, g, m, v, c);
    const uint32_t noise = rounding_hash(index ^ salt);
    m16 = stochastic_bf16(m, noise & 0xFFFFU);
    v16 = stochastic_bf16(v, noise >> 16);
}

// The update of n elements, the first of which has index `first` in its parameter, with an fp32
// or a bf16 gradient, in one pass. The earlier form widened the moments into fp32 scratch,
// updated them there and narrowed them back: four passes over each block, with the cores, not
// the memory, setting the pace (1.4x slower on 16 cores; bench/RESULTS.md round 26).
__attribute__((target_clones("avx512f", "avx2", "default"))) void
bf16_state_f32_grad(float *__restrict p, const float *__restrict g, uint16_t *__restrict m,
                    uint16_t *__restrict v, int64_t n, uint32_t first, AdamWConstants c,
                    uint32_t salt) {
    for (int64_t i = 0; i < n; ++i)
        bf16_state_element(p[i], g[i], m[i], v[i], first + static_cast<uint32_t>(i), c, salt);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
bf16_state_bf16_grad(float *__restrict p, const uint16_t *__restrict g, uint16_t *__restrict m,
                     uint16_t *__restrict v, int64_t n, uint32_t first, AdamWConstants c,
                     uint32_t salt) {
    for (int64_t i = 0; i < n; ++i)
        bf16_state_element(p[i], bf16_value(g[i]), m[i], v[i], first + static_cast<uint32_t>(i), c,
                           salt);
}

// The bf16-state update of elements [begin, end) of one parameter (see adamw_update_bf16_state),
// a block at a time so that the weight copy and the zeroing read the block while it is in the
// cache. A GradSpan with no array is a zero gradient.
void bf16_state_range(float *param, const GradSpan &grad, uint16_t *exp_avg, uint16_t *exp_avg_sq,
                      int64_t begin, int64_t end, const AdamWConstants &c, uint32_t salt,
                      uint16_t *live_bf16, bool zero_grad) {
    static const float zeros[kBf16Block] = {};
    for (int64_t b = begin; b < end; b += kBf16Block) {
        const int64_t len = std::min(kBf16Block, end - b);
        const uint32_t first = static_cast<uint32_t>(b); // the rounding's index, as uint32
        if (grad.bf16 && !grad.f32)
            bf16_state_bf16_grad(param + b, grad.bf16 + b, exp_avg + b, exp_avg_sq + b, len, first,
                                 c, salt);
        else
            bf16_state_f32_grad(param + b, grad.f32 ? grad.f32 + b : zeros, exp_avg + b,
                                exp_avg_sq + b, len, first, c, salt);
        publish_block(param, live_bf16, grad, b, len, zero_grad);
    }
}

} // namespace

void adamw_update_bf16_state(float *param, const GradSpan &grad, uint16_t *exp_avg,
                             uint16_t *exp_avg_sq, int64_t n, const AdamWHyper &h, int64_t step,
                             uint64_t param_index, uint16_t *live_bf16, bool zero_grad) {
    const AdamWConstants c = constants(h, step);
    const uint32_t salt = rounding_salt(step, param_index, 0);
    optimizer_parallel_for(0, n, kOptimizerBlock, kGrain, [&](int64_t begin, int64_t end) {
        bf16_state_range(param, grad, exp_avg, exp_avg_sq, begin, end, c, salt, live_bf16,
                         zero_grad);
    });
}

void adamw_update_bf16_state_rows(float *param, const GradSpan &grad, uint16_t *exp_avg,
                                  uint16_t *exp_avg_sq, int64_t row_begin, int64_t row_end,
                                  int64_t width, const uint8_t *mask, uint8_t want,
                                  const AdamWHyper &h, int64_t step, uint64_t param_index,
                                  uint16_t *live_bf16, bool zero_grad) {
    const AdamWConstants c = constants(h, step);
    const uint32_t salt = rounding_salt(step, param_index, 0);
    // Rows, not elements, are split over the threads (a row is wanted or not as a whole); about
    // kGrain elements a task.
    const int64_t grain_rows = std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1));
    const int64_t block_rows = std::max<int64_t>(1, kOptimizerBlock / std::max<int64_t>(width, 1));
    optimizer_parallel_for(row_begin, row_end, block_rows, grain_rows, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            if (mask[r] == want)
                bf16_state_range(param, grad, exp_avg, exp_avg_sq, r * width, (r + 1) * width, c,
                                 salt, live_bf16, zero_grad);
    });
}

} // namespace rp
