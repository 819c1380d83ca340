// bf16 storage for optimizer state and gradients in memory-saving mode. The update arithmetic
// stays fp32: blocks are widened into scratch, updated by the fp32 kernels and narrowed back.
#pragma once
#include <cstdint>

namespace rp {

// A gradient array in fp32 or bf16 (bit patterns); exactly one pointer is set. Writable: the
// memory-saving update zeroes the gradient in the pass that reads it.
struct GradSpan {
    float *f32 = nullptr;
    uint16_t *bf16 = nullptr;
};

// Elements per block of scratch: three fp32 blocks stay within a core's L1 cache.
constexpr int64_t kBf16Block = 2048;

void widen_bf16(const uint16_t *in, float *out, int64_t n);

// out[i] += factor * in[i], in bf16: a low-precision gradient added into an fp32 one (one thread;
// the caller splits the range).
void add_widened_bf16(const uint16_t *in, float *out, int64_t n, float factor);

// Rounds to bf16 stochastically: up with probability equal to the dropped fraction, so the
// rounding is unbiased. Round-to-nearest would lose updates smaller than half a bf16 ulp for
// good (AdamW's second moment changes by 0.1% a step, bf16 resolves 0.4%), so the state would
// stop decaying. The random bits are a hash of the element index and `salt`: deterministic,
// independent of the thread split.
void narrow_bf16_stochastic(const float *in, uint16_t *out, int64_t n, uint64_t first_index,
                            uint32_t salt);

// Rounds to the nearest bf16, ties to even, NaN kept: bit for bit what a tensor copy to bf16
// gives, so weights written here equal those a later copy from the master would write.
void narrow_bf16_nearest(const float *in, uint16_t *out, int64_t n);

// narrow_bf16_stochastic of two arrays at once from one hash per element (its low half rounds
// `a`, its high half `b`): AdamW's two moments for the price of one hash.
void narrow_two_bf16_stochastic(const float *a_in, uint16_t *a_out, const float *b_in,
                                uint16_t *b_out, int64_t n, uint64_t first_index, uint32_t salt);

// A salt for one (step, parameter, state array) triple.
uint32_t rounding_salt(int64_t step, uint64_t param, uint32_t which);

} // namespace rp
