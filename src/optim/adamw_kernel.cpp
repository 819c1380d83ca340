#include "optim/adamw_kernel.h"

#include <cmath>

#include <ATen/Parallel.h>

namespace rp {
namespace {

// Big enough that a thread's share amortises the fork; small enough to split 1e6 elements.
constexpr int64_t kGrain = 1 << 15;

// target_clones gives AVX-512 and AVX2 bodies with a run-time dispatch, so one binary uses the
// widest vectors the host has. The loop is written so GCC vectorises it (no aliasing, no
// branches; the file is built with -O3 -fno-math-errno so sqrt vectorises too).
__attribute__((target_clones("avx512f", "avx2", "default"))) void
adamw_range(float *__restrict p, const float *__restrict g, float *__restrict m,
            float *__restrict v, int64_t n, float decay, float one_minus_b1, float b2,
            float one_minus_b2, float inv_bc2_sqrt, float eps, float step_size) {
    for (int64_t i = 0; i < n; ++i) {
        float gi = g[i];
        float mi = m[i] + (gi - m[i]) * one_minus_b1; // torch: exp_avg.lerp_(grad, 1 - beta1)
        float vi = v[i] * b2 + one_minus_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float denom = std::sqrt(vi) * inv_bc2_sqrt + eps;
        p[i] = p[i] * decay - step_size * mi / denom;
    }
}

} // namespace

void adamw_update(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                  const AdamWHyper &h, int64_t step) {
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
    const float decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
    const float step_size = static_cast<float>(h.lr / bc1);
    const float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        adamw_range(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin,
                    end - begin, decay, static_cast<float>(1.0 - h.beta1),
                    static_cast<float>(h.beta2), static_cast<float>(1.0 - h.beta2), inv_bc2_sqrt,
                    static_cast<float>(h.eps), step_size);
    });
}

} // namespace rp
