// The streaming bf16 narrowing the optimizer writes weight copies with
// (src/optim/bf16_convert.h, narrow_bf16_nearest_streaming) against libtorch's own fp32 -> bf16
// tensor copy (round to nearest, ties to even; a NaN stays a NaN): bit for bit over random bit
// patterns, the special values, every start alignment of the destination and lengths around the
// vector widths; and nothing written outside the range. Also the ordinary-store narrowing, which
// the streaming one falls back to on CPUs without AVX-512.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <ATen/ATen.h>

#include "optim/bf16_convert.h"

static int failures = 0;

using Narrow = void (*)(const float *, uint16_t *, int64_t);

// Narrows in[0, n) into a buffer at `offset` elements past a 64-byte boundary, with guard values
// around it, and compares with at::Tensor::to(kBFloat16).
static void check(Narrow narrow, const char *name, const std::vector<float> &in, int64_t n,
                  int64_t offset) {
    constexpr uint16_t kGuard = 0xA5A5;
    const int64_t padded = n + offset + 64;
    std::vector<uint16_t> storage(padded + 32, kGuard);
    auto base = reinterpret_cast<uintptr_t>(storage.data());
    uint16_t *aligned = storage.data() + ((64 - (base & 63)) & 63) / 2;
    uint16_t *out = aligned + offset;
    narrow(in.data(), out, n);
    at::Tensor want = at::from_blob(const_cast<float *>(in.data()), {n}, at::kFloat)
                          .to(at::kBFloat16)
                          .contiguous();
    const auto *w = reinterpret_cast<const uint16_t *>(want.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
        // A NaN must stay a NaN; its bits are not compared: libtorch's own copy writes 0x7FC0
        // from its scalar loop and 0xFFFF from its AVX-512 one, so it has no single answer.
        const bool both_nan = std::isnan(in[i]) && (out[i] & 0x7FFFU) > 0x7F80U;
        if (out[i] != w[i] && !both_nan) {
            uint32_t bits;
            std::memcpy(&bits, &in[i], sizeof bits);
            std::fprintf(stderr, "FAIL %s n=%lld offset=%lld: element %lld (bits %08x) gave %04x, "
                                 "the tensor copy %04x\n",
                         name, static_cast<long long>(n), static_cast<long long>(offset),
                         static_cast<long long>(i), bits, out[i], w[i]);
            ++failures;
            return;
        }
    }
    for (uint16_t *g = storage.data(); g < storage.data() + storage.size(); ++g)
        if ((g < out || g >= out + n) && *g != kGuard) {
            std::fprintf(stderr, "FAIL %s n=%lld offset=%lld: wrote outside the range\n", name,
                         static_cast<long long>(n), static_cast<long long>(offset));
            ++failures;
            return;
        }
}

int main() {
    std::mt19937 gen(7);
    std::vector<float> in(1 << 16);
    for (float &x : in) { // random bit patterns: every exponent, NaNs, infinities, subnormals
        uint32_t bits = gen();
        std::memcpy(&x, &bits, sizeof bits);
    }
    const float special[] = {0.0f,
                             -0.0f,
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN(),
                             -std::numeric_limits<float>::quiet_NaN(),
                             std::numeric_limits<float>::max(),
                             std::numeric_limits<float>::denorm_min(),
                             1.00390625f,  // 1 + 2^-8: a tie, rounds to even (down)
                             1.01171875f}; // 1 + 3 * 2^-8: a tie, rounds to even (up)
    for (size_t i = 0; i < sizeof special / sizeof special[0]; ++i)
        in[i * 7] = special[i];
    uint32_t signalling = 0x7F800001U; // a signalling NaN: quieted, like the tensor copy
    std::memcpy(&in[3], &signalling, sizeof signalling);

    const struct {
        Narrow fn;
        const char *name;
    } kinds[] = {{rp::narrow_bf16_nearest_streaming, "streaming"},
                 {rp::narrow_bf16_nearest, "ordinary stores"}};
    for (const auto &k : kinds) {
        for (int64_t offset = 0; offset < 32; ++offset)
            for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1000})
                check(k.fn, k.name, in, n, offset);
        check(k.fn, k.name, in, static_cast<int64_t>(in.size()), 3);
    }
    if (failures == 0)
        std::printf("bf16_narrowing: streaming and ordinary narrowing equal the tensor copy\n");
    return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
