#include "optim/bf16_convert.h"

#include <cstring>

namespace rp {
namespace {

inline uint32_t mix32(uint32_t x) {
    // lowbias32 (Chris Wellons): a good avalanche with two multiplies, vectorisable.
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

} // namespace

__attribute__((target_clones("avx512f", "avx2", "default"))) void
widen_bf16(const uint16_t *__restrict in, float *__restrict out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
        std::memcpy(&out[i], &bits, sizeof bits);
    }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
add_widened_bf16(const uint16_t *__restrict in, float *__restrict out, int64_t n, float factor) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
        float x;
        std::memcpy(&x, &bits, sizeof bits);
        out[i] += factor * x;
    }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
narrow_bf16_stochastic(const float *__restrict in, uint16_t *__restrict out, int64_t n,
                       uint64_t first_index, uint32_t salt) {
    const uint32_t base = static_cast<uint32_t>(first_index);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &in[i], sizeof bits);
        // Adding uniform noise below the kept bits carries into them with the right
        // probability; it works on the magnitude, so negative values round unbiasedly too.
        // Infinity stays infinity (its low bits are zero and the carry cannot pass 0xFFFF).
        uint32_t noise = mix32((base + static_cast<uint32_t>(i)) ^ salt) & 0xFFFFU;
        out[i] = static_cast<uint16_t>((bits + noise) >> 16);
    }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
narrow_two_bf16_stochastic(const float *__restrict a_in, uint16_t *__restrict a_out,
                           const float *__restrict b_in, uint16_t *__restrict b_out, int64_t n,
                           uint64_t first_index, uint32_t salt) {
    const uint32_t base = static_cast<uint32_t>(first_index);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t a, b;
        std::memcpy(&a, &a_in[i], sizeof a);
        std::memcpy(&b, &b_in[i], sizeof b);
        const uint32_t noise = mix32((base + static_cast<uint32_t>(i)) ^ salt);
        a_out[i] = static_cast<uint16_t>((a + (noise & 0xFFFFU)) >> 16);
        b_out[i] = static_cast<uint16_t>((b + (noise >> 16)) >> 16);
    }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
narrow_bf16_nearest(const float *__restrict in, uint16_t *__restrict out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &in[i], sizeof bits);
        const uint32_t rounded = (bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16;
        const bool nan = (bits & 0x7FFFFFFFU) > 0x7F800000U;
        out[i] = static_cast<uint16_t>(nan ? 0x7FC0U : rounded);
    }
}

uint32_t rounding_salt(int64_t step, uint64_t param, uint32_t which) {
    return mix32(static_cast<uint32_t>(step) * 0x9E3779B9U ^ mix32(static_cast<uint32_t>(param)) ^
                 (which * 0x85EBCA6BU));
}

} // namespace rp
