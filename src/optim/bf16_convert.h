// bf16 storage for optimizer state and gradients in memory-saving mode. The update arithmetic
// stays fp32: the optimizers' loops (adamw_kernel.cpp, sgd_kernel.cpp) widen each element's
// state, update it and round it back in registers, with the hash and the rounding below.
#pragma once
#include <cstdint>
#include <cstring>

namespace rp {

// A gradient array in fp32 or bf16 (bit patterns); one pointer is set. Writable: the
// memory-saving update zeroes the gradient in the pass that reads it.
// Both are set, with `f32_rows`, for a lent bf16 gradient to which rows were added in the fp32
// buffer (a tied embedding's rows added to its LM-head part, ParamStore::mark_rows_added): on
// the rows marked in `f32_rows` (one byte per row of `row_width` elements) the gradient is
// f32 + bf16, and the standard step zeroes the fp32 rows as it reads them; elsewhere it is bf16.
struct GradSpan {
    float *f32 = nullptr;
    uint16_t *bf16 = nullptr;
    const uint8_t *f32_rows = nullptr;
    int64_t row_width = 0;
};

// Elements per block of scratch: three fp32 blocks stay within a core's L1 cache.
constexpr int64_t kBf16Block = 2048;

void widen_bf16(const uint16_t *in, float *out, int64_t n);

// out[i] += factor * in[i], in bf16: a low-precision gradient added into an fp32 one (one thread;
// the caller splits the range).
void add_widened_bf16(const uint16_t *in, float *out, int64_t n, float factor);

// out[rows[k]] += factor * values[k] for each of the n rows (`width` elements each) of a row
// gradient, in order (a row used twice adds twice, in fp32): an embedding's rows added into its
// fp32 gradient. Parallel over column blocks, so no two threads write one element.
void add_rows_widened_bf16(const uint16_t *values, const int64_t *rows, int64_t n, int64_t width,
                           float *out, float factor);

// out[rows[k]] += factor * values[k] for each of the n rows (`width` elements each) of a row
// gradient, into a bf16 gradient (memory-saving mode): each row used is widened, its uses added in
// fp32 in order, and the row rounded back (to nearest) once. With factor 1 these are the bits of
// libtorch's index_add_ on the bf16 tensor, which took 3.4x as long for 4,096 rows of 4,096 on two
// cores. Parallel over distinct rows.
void add_rows_into_bf16(const uint16_t *values, const int64_t *rows, int64_t n, int64_t width,
                        uint16_t *out, float factor);

// out[i] = a[i] + b[i], both widened: two bf16 gradients summed into fp32 in one pass, the same
// bits as widening `a` and then adding `b` (one thread; the caller splits the range).
void sum_widened_bf16(const uint16_t *a, const uint16_t *b, float *out, int64_t n);

// Rounds to the nearest bf16, ties to even, NaN kept (as 0x7FC0): bit for bit what a tensor copy
// to bf16 gives for every number, so weights written here equal those a later copy from the
// master would write (a NaN is a NaN in both; the copy's bits for it vary with its code path).
void narrow_bf16_nearest(const float *in, uint16_t *out, int64_t n);

// The same values written with non-temporal (streaming) stores where the CPU has AVX-512, for a
// destination nobody reads soon (the weight copy the next upload reads): an
// ordinary store first reads each line it writes into the cache (a read for ownership), so this
// halves the memory traffic of the copy. Visible to other threads and to DMA once the call
// returns (it ends with a store fence). Elsewhere it is narrow_bf16_nearest.
void narrow_bf16_nearest_streaming(const float *in, uint16_t *out, int64_t n);

// After the update of elements [b, b + len) of a parameter, while they are in the cache: the
// weight copy `live_bf16` (if not null) written from `param` (narrow_bf16_nearest_streaming:
// the devices read it next), and the gradient zeroed if `zero_grad` (its lines were just read,
// so that costs no second trip; a GradSpan with no array is left alone).
void publish_block(const float *param, uint16_t *live_bf16, const GradSpan &grad, int64_t b,
                   int64_t len, bool zero_grad);

// A salt for one (step, parameter, state array) triple.
uint32_t rounding_salt(int64_t step, uint64_t param, uint32_t which);

// A bf16 bit pattern's value in fp32 (exact: the pattern is the top half of the fp32 one).
// Inline, so the optimizer's loops widen in registers.
inline float bf16_value(uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float x;
    std::memcpy(&x, &wide, sizeof x);
    return x;
}

// The hash behind stochastic rounding: lowbias32 (Chris Wellons), a good avalanche with two
// multiplies, vectorisable. Inline, for the optimizer's one-pass loops (adamw_kernel.cpp).
inline uint32_t rounding_hash(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// `x` rounded to bf16 stochastically with `noise` (16 random bits): up with probability equal to
// the dropped fraction, so the rounding is unbiased. Round-to-nearest would lose updates smaller
// than half a bf16 ulp for good (AdamW's second moment changes by 0.1% a step, bf16 resolves 0.4%),
// so the state would stop decaying. Adding uniform noise below the kept bits carries into them with
// the right probability; it works on the magnitude, so negative values round unbiasedly too.
// Infinity stays infinity (its low bits are zero and the carry cannot pass 0xFFFF). The optimizers
// take the noise from rounding_hash(element index ^ salt): deterministic, independent of the thread
// split.
inline uint16_t stochastic_bf16(float x, uint32_t noise) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return static_cast<uint16_t>((bits + noise) >> 16);
}

} // namespace rp
