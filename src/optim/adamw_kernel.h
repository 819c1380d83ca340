// CPU AdamW over fp32 arrays, with torch.optim.AdamW's arithmetic (decoupled weight decay,
// bias correction), split across libtorch's intra-op threads and vectorised by the compiler.
#pragma once
#include <cstdint>

#include "optim/bf16_convert.h"

namespace rp {

struct AdamWHyper {
    double lr, beta1, beta2, eps, weight_decay;
};

// `step` is the 1-based number of this update (bias correction).
void adamw_update(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                  const AdamWHyper &h, int64_t step);

// adamw_update, then, in the same pass over memory (a block at a time, while it is in cache),
// the updated weights rounded to the nearest bf16 into `live_bf16` (bit for bit a tensor copy of
// the master) and an fp32 gradient zeroed: the standard mode's whole step for a bf16 model, whose
// separate copy and zeroing passes read the master and write the gradient once more. A bf16
// gradient (a download lent where it landed) is widened block by block, exactly, and left alone;
// where rows were added to it in fp32 (GradSpan), those are added in and zeroed in the buffer.
// The weight copy is written with streaming stores (narrow_bf16_nearest_streaming: nothing reads
// it before the next upload); `Cached` keeps ordinary stores, for adamw_bench's comparison.
enum class WeightStores { Streaming, Cached };
void adamw_update_publish(float *param, const GradSpan &grad, float *exp_avg, float *exp_avg_sq,
                          int64_t n, const AdamWHyper &h, int64_t step, uint16_t *live_bf16,
                          WeightStores stores = WeightStores::Streaming);

// torch.optim.Adam's update with L2 weight decay (decoupled_weight_decay=False): the moments see
// grad + weight_decay * param; the gradient itself is left unchanged, as torch leaves p.grad.
void adam_l2_update(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                    const AdamWHyper &h, int64_t step);

// The same update with both moments stored in bf16 (stochastically rounded, see
// bf16_convert.h) and the gradient in fp32 or bf16. `param_index` decorrelates the rounding of
// different parameters. A gradient with rows in fp32 (GradSpan::f32_rows) is not accepted here.
// `live_bf16` (may be null) receives the updated weights rounded to bf16 and `zero_grad` zeroes
// the gradient, in the same pass over memory: what memory-saving mode does after each update.
void adamw_update_bf16_state(float *param, const GradSpan &grad, uint16_t *exp_avg,
                             uint16_t *exp_avg_sq, int64_t n, const AdamWHyper &h, int64_t step,
                             uint64_t param_index, uint16_t *live_bf16 = nullptr,
                             bool zero_grad = false);

// adamw_update_bf16_state over some rows of a [rows, width] parameter: those of rows
// [row_begin, row_end) whose `mask` byte (one per row of the whole parameter) equals `want`, the
// others untouched. Each element gets bit for bit what the whole update gives it (the same
// arithmetic, and stochastic rounding keyed on its index in the whole parameter), so a step may
// update a parameter's rows in parts, in any order, all with the same `step`. A GradSpan with no
// array is a zero gradient (nothing read): an embedding's rows that no token used. For an
// embedding whose untouched rows' update is deferred past the touched ones.
void adamw_update_bf16_state_rows(float *param, const GradSpan &grad, uint16_t *exp_avg,
                                  uint16_t *exp_avg_sq, int64_t row_begin, int64_t row_end,
                                  int64_t width, const uint8_t *mask, uint8_t want,
                                  const AdamWHyper &h, int64_t step, uint64_t param_index,
                                  uint16_t *live_bf16, bool zero_grad);

} // namespace rp
