#include "optim/bf16_convert.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include <immintrin.h>

#include <ATen/Parallel.h>

namespace rp {
namespace {

// Round to nearest, ties to even; a NaN becomes the quiet NaN 0x7FC0. Branch-free, so the loops
// that call it vectorise.
inline uint16_t nearest_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16;
    const bool nan = (bits & 0x7FFFFFFFU) > 0x7F800000U;
    return static_cast<uint16_t>(nan ? 0x7FC0U : rounded);
}

} // namespace

__attribute__((target_clones("avx512f", "avx2", "default"))) void
widen_bf16(const uint16_t *__restrict in, float *__restrict out, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        out[i] = bf16_value(in[i]);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
add_widened_bf16(const uint16_t *__restrict in, float *__restrict out, int64_t n, float factor) {
    for (int64_t i = 0; i < n; ++i)
        out[i] += factor * bf16_value(in[i]);
}

void add_rows_widened_bf16(const uint16_t *values, const int64_t *rows, int64_t n, int64_t width,
                           float *out, float factor) {
    // 64 columns (256 bytes of fp32) at least per block: whole cache lines per thread.
    at::parallel_for(0, width, 64, [&](int64_t begin, int64_t end) {
        for (int64_t k = 0; k < n; ++k)
            add_widened_bf16(values + k * width + begin, out + rows[k] * width + begin,
                             end - begin, factor);
    });
}

void add_rows_into_bf16(const uint16_t *values, const int64_t *rows, int64_t n, int64_t width,
                        uint16_t *out, float factor) {
    // The uses grouped by row, each group in the order of the uses (a stable sort), so a row's
    // sum does not depend on how the groups are split over threads.
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return rows[a] < rows[b]; });
    std::vector<int64_t> group_starts;
    for (int64_t k = 0; k < n; ++k)
        if (k == 0 || rows[order[k]] != rows[order[k - 1]])
            group_starts.push_back(k);
    const auto groups = static_cast<int64_t>(group_starts.size());
    group_starts.push_back(n);
    at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> row(static_cast<size_t>(width));
        for (int64_t g = begin; g < end; ++g) {
            uint16_t *dst = out + rows[order[group_starts[g]]] * width;
            widen_bf16(dst, row.data(), width);
            for (int64_t k = group_starts[g]; k < group_starts[g + 1]; ++k)
                add_widened_bf16(values + order[k] * width, row.data(), width, factor);
            narrow_bf16_nearest(row.data(), dst, width);
        }
    });
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
sum_widened_bf16(const uint16_t *__restrict a, const uint16_t *__restrict b, float *__restrict out,
                 int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        out[i] = bf16_value(a[i]) + bf16_value(b[i]);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void
narrow_bf16_nearest(const float *__restrict in, uint16_t *__restrict out, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        out[i] = nearest_bf16(in[i]);
}

namespace {

// Elements to write one at a time before `out + i` sits on an `align`-byte boundary, at most n.
int64_t head_until_aligned(const uint16_t *out, int64_t n, uintptr_t align) {
    const uintptr_t misalign = reinterpret_cast<uintptr_t>(out) & (align - 1);
    if (misalign == 0)
        return 0;
    if (misalign & 1U) // an odd address never aligns: everything goes through the scalar path
        return n;
    return std::min<int64_t>(n, static_cast<int64_t>((align - misalign) / 2));
}

// Sixteen elements a store: 32 bytes, one half of a cache line, on a 32-byte boundary.
// GCC 12 warns that its own AVX-512 intrinsics read an "uninitialised" register (their
// _mm512_undefined_* pass-through operand); a known false positive, silenced for this function.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) void narrow_streaming_avx512(const float *in, uint16_t *out,
                                                                  int64_t n) {
    int64_t i = head_until_aligned(out, n, 32);
    for (int64_t k = 0; k < i; ++k)
        out[k] = nearest_bf16(in[k]);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    const __m512i quiet_nan = _mm512_set1_epi32(0x7FC0);
    for (; i + 16 <= n; i += 16) {
        const __m512i bits = _mm512_loadu_si512(in + i);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, odd)), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), inf);
        rounded = _mm512_mask_mov_epi32(rounded, nan, quiet_nan);
        _mm256_stream_si256(reinterpret_cast<__m256i *>(out + i), _mm512_cvtepi32_epi16(rounded));
    }
    for (; i < n; ++i)
        out[i] = nearest_bf16(in[i]);
    _mm_sfence();
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

} // namespace

void narrow_bf16_nearest_streaming(const float *in, uint16_t *out, int64_t n) {
    static const bool avx512 = __builtin_cpu_supports("avx512f");
    if (avx512)
        narrow_streaming_avx512(in, out, n);
    else
        narrow_bf16_nearest(in, out, n);
}

void publish_block(const float *param, uint16_t *live_bf16, const GradSpan &grad, int64_t b,
                   int64_t len, bool zero_grad) {
    if (live_bf16)
        narrow_bf16_nearest_streaming(param + b, live_bf16 + b, len);
    if (zero_grad && grad.f32)
        std::memset(grad.f32 + b, 0, sizeof(float) * len);
    else if (zero_grad && grad.bf16)
        std::memset(grad.bf16 + b, 0, sizeof(uint16_t) * len);
}

uint32_t rounding_salt(int64_t step, uint64_t param, uint32_t which) {
    return rounding_hash(static_cast<uint32_t>(step) * 0x9E3779B9U ^
                         rounding_hash(static_cast<uint32_t>(param)) ^ (which * 0x85EBCA6BU));
}

} // namespace rp
