// Fused token cross entropy over a chunk of logits, for the LM head's chunked loss: one pass
// over the logits as the GEMM wrote them (model dtype) gives each token's loss and overwrites
// the logits with their gradient, so no fp32 [tokens, vocab] tensor is ever made.
#pragma once
#include <cstdint>

#include <ATen/ATen.h>

namespace rp {
namespace kernels {

// `logits` [n, vocab] (fp32, bf16 or fp16; on the CPU or a CUDA device; unit stride along the
// vocabulary) and `targets` [n] (int64, same device; `ignore_index` marks a token without a
// target). Returns the per-token loss [n] in fp32: logsumexp(row) - row[target], 0 for ignored
// tokens. The row maximum, the logsumexp and the softmax are computed in fp32 from the stored
// logits, as `at::cross_entropy(logits.to(at::kFloat), targets, reduction none)` does.
//
// With `write_grad`, every row of `logits` is overwritten in place with the gradient of that
// row's loss, (softmax - one_hot(target)) for tokens with a target and 0 for ignored ones,
// computed in fp32 and rounded once (to nearest even) to the logits' dtype: what autograd gives
// for the fp32 cross entropy followed by the backward of the cast to fp32. Without it, `logits`
// is only read.
//
// A target outside [0, vocab) other than `ignore_index` gives a NaN loss for its token (a GPU
// kernel cannot throw; callers check label ranges on the host, as the engine does). Runs on the
// current CUDA stream of the logits' device; asynchronous there like any ATen op.
at::Tensor cross_entropy_(at::Tensor &logits, const at::Tensor &targets, int64_t ignore_index,
                          bool write_grad);

} // namespace kernels
} // namespace rp
