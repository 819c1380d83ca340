// The LM head of a causal LM: the projection to the vocabulary, fused with the shifted token
// cross entropy when the tail stage of a training call gives it labels.
#include <algorithm>
#include <cmath>
#include <limits>

#include <torch/csrc/autograd/custom_function.h>

#include "kernels/cross_entropy.h"
#include "layers/transformer_layers.h"

namespace rp {
namespace {

// Tokens per loss chunk, at most: M = 4096 already saturates the GEMMs (4096 x 151,936 x 2048
// is 2.5 TFLOP), and a longer chunk only raises the peak (4096 bf16 rows of Qwen3's vocabulary
// are 1.2 GiB).
constexpr int64_t kMaxChunkTokens = 4096;
// Chunks are cut at multiples of this (the GEMMs' tile height) when they hold more.
constexpr int64_t kChunkGranule = 128;
// Where devices have no memory cap (CPU devices): logits of a chunk, at most 128 MiB.
constexpr double kUncappedChunkBytes = double(int64_t{1} << 27);

// Sum over tokens with a target of cross_entropy(h W^T, target), `chunk` tokens at a time.
// The fused tail stage always back-propagates right after the forward, so the gradients are
// computed in the same pass over the chunks (the logits of a chunk are made once) and scaled by
// the incoming gradient in backward.
//
// Per chunk: the GEMM writes the logits in the model dtype; kernels::cross_entropy_ reads them
// once for the fp32 logsumexp and the losses and overwrites them with the gradient
// (softmax - one_hot), computed in fp32 and rounded once to the model dtype, which is what
// transformers' loss (cross entropy of the fp32 upcast) gives before its backward multiplies in
// the incoming gradient; here that scalar multiplies grad_h and grad_w afterwards. The two
// backward GEMMs then read that gradient in place.
class ChunkedCausalLmLoss : public torch::autograd::Function<ChunkedCausalLmLoss> {
  public:
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &h,
                              const at::Tensor &w, const at::Tensor &targets, int64_t chunk,
                              bool want_grad, bool want_grad_w) {
        const int64_t n = h.size(0);
        const bool low_precision = h.scalar_type() != at::kFloat;
        at::Tensor losses = at::empty({n}, h.options().dtype(at::kFloat));
        at::Tensor grad_h, grad_w;
        if (want_grad) {
            grad_h = at::empty({n, h.size(1)}, h.options());
            // Low-precision weights: accumulate the chunks' contributions in fp32. A frozen
            // head (LoRA) needs only grad_h.
            if (want_grad_w)
                grad_w = at::zeros(w.sizes(), w.options().dtype(at::kFloat));
        }
        for (int64_t start = 0; start < n; start += chunk) {
            const int64_t len = std::min(chunk, n - start);
            at::Tensor hc = h.narrow(0, start, len);
            at::Tensor g = at::mm(hc, w.t()); // logits, then their gradient in place
            losses.narrow(0, start, len)
                .copy_(kernels::cross_entropy_(g, targets.narrow(0, start, len), kIgnoreIndex,
                                               want_grad));
            if (!want_grad)
                continue;
            at::Tensor grad_hc = grad_h.narrow(0, start, len);
            at::mm_out(grad_hc, g, w);
            if (!want_grad_w)
                continue;
            if (!low_precision)
                grad_w.addmm_(g.t(), hc);
            else if (grad_w.is_cuda())
                // bf16/fp16 inputs, fp32 accumulator: cuBLAS adds into grad_w (beta = 1), so no
                // [vocab, dim] fp32 temporary is made and added once per chunk.
                at::addmm_out(grad_w, grad_w, g.t(), hc, at::kFloat);
            else
                grad_w.add_(at::mm(g.t(), hc)); // the CPU has no mixed-dtype addmm
        }
        ctx->saved_data["grad_h"] = grad_h;
        ctx->saved_data["grad_w"] = grad_w;
        ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
        return losses.sum();
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grad_out) {
        at::Tensor grad_h = ctx->saved_data["grad_h"].toTensor();
        at::Tensor grad_w = ctx->saved_data["grad_w"].toTensor();
        TORCH_CHECK(grad_h.defined(), "lm_head: the fused loss was computed without gradients");
        const at::Tensor &g = grad_out[0];
        auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
        // In place: backward runs once, and a second [vocab, dim] buffer would raise the peak.
        ctx->saved_data.clear();
        grad_h.mul_(g.to(grad_h.scalar_type()));
        if (grad_w.defined())
            grad_w = grad_w.mul_(g).to(w_dtype);
        return {grad_h, grad_w, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

class LmHead final : public Layer {
  public:
    LmHead(int64_t dim, int64_t vocab, const std::string &tied_to, double init_std,
           int64_t chunk_tokens)
        : dim_(dim), vocab_(vocab), chunk_tokens_(chunk_tokens) {
        ParamSpec weight = normal_param("weight", {vocab, dim}, init_std);
        weight.tied_to = tied_to;
        params_.push_back(std::move(weight));
    }
    std::string type() const override { return "lm_head"; }
    int64_t label_index_limit() const override { return vocab(); }
    void grant_workspace(double bytes, at::ScalarType compute_dtype) override {
        granted_bytes_ = bytes;
        compute_dtype_ = compute_dtype;
    }
    // The fp32 [vocab, dim] gradient accumulator and one chunk of logits (overwritten by their
    // gradient) with its fp32 losses.
    double workspace_bytes() const override {
        return (weight_trainable() ? accumulator_bytes() : 0.0) +
               static_cast<double>(chunk_for(compute_dtype_)) * token_bytes(compute_dtype_);
    }
    int64_t vocab() const { return vocab_; }
    // The fused loss keeps the gradient of its input and the int64 targets; without labels it
    // keeps its input, the same size.
    double activation_bytes_per_token(double dtype_bytes) const override {
        return dtype_bytes * static_cast<double>(dim_) + 8.0;
    }

    at::Tensor forward(const std::vector<at::Tensor> &p, const at::Tensor &x,
                       const LayerContext &ctx) const override {
        TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == dim_, "lm_head needs inputs [..., ", dim_,
                          "], got ", x.sizes());
        const at::Tensor &w = p[0];
        if (!ctx.labels || !ctx.labels->defined() || at::isFloatingType(ctx.labels->scalar_type()))
            return at::linear(x, w);
        const at::Tensor &labels = *ctx.labels;
        TORCH_CHECK_VALUE(x.dim() == 3 && labels.dim() == 2 && labels.size(0) == x.size(0) &&
                              labels.size(1) == x.size(1),
                          "lm_head: labels must be [batch, seq] like the token ids; got labels ",
                          labels.sizes(), " for hidden states ", x.sizes());
        TORCH_CHECK_VALUE(x.size(1) >= 1, "lm_head: sequences must hold at least one token");
        const int64_t b = x.size(0), t = x.size(1);
        // Token i predicts label i + 1; the last token of each row has no target.
        at::Tensor targets =
            at::cat({labels.narrow(1, 1, t - 1).to(at::kLong),
                     at::full({b, 1}, kIgnoreIndex, labels.options().dtype(at::kLong))},
                    1)
                .reshape({-1});
        at::Tensor h = x.reshape({-1, dim_});
        const bool want_grad =
            at::GradMode::is_enabled() && (h.requires_grad() || w.requires_grad());
        return ChunkedCausalLmLoss::apply(h, w, targets, chunk_for(h.scalar_type()), want_grad,
                                          want_grad && w.requires_grad());
    }

  private:
    // A frozen head (every parameter of a LoRA model but the adapters) has no weight gradient.
    bool weight_trainable() const { return params_[0].role == ParamRole::Trainable; }
    double accumulator_bytes() const {
        return 4.0 * static_cast<double>(vocab_) * static_cast<double>(dim_);
    }
    // A chunk's logits in the compute dtype and its fp32 losses, per token.
    double token_bytes(at::ScalarType dtype) const {
        return static_cast<double>(vocab_) * static_cast<double>(c10::elementSize(dtype)) + 4.0;
    }
    // Tokens per loss chunk: the spec's `chunk_tokens` when given; else as many as the grant
    // leaves room for beside the gradient accumulator, within [1, kMaxChunkTokens], cut to the
    // GEMMs' granule. A grant too small even for the accumulator gives one-token chunks: the
    // planner then finds the layer too large for a stage and says so.
    int64_t chunk_for(at::ScalarType dtype) const {
        if (chunk_tokens_ > 0)
            return chunk_tokens_;
        const double accumulator = weight_trainable() ? accumulator_bytes() : 0.0;
        const double room = std::isfinite(granted_bytes_) ? granted_bytes_ - accumulator
                                                          : kUncappedChunkBytes;
        const double fit = std::floor(room / token_bytes(dtype));
        int64_t chunk =
            fit < 1.0 ? 1 : static_cast<int64_t>(std::min(fit, double(kMaxChunkTokens)));
        if (chunk > kChunkGranule)
            chunk -= chunk % kChunkGranule;
        return chunk;
    }

    int64_t dim_;
    int64_t vocab_;
    int64_t chunk_tokens_;
    // Set once by the model before any call (grant_workspace); uncapped until then.
    double granted_bytes_ = std::numeric_limits<double>::infinity();
    at::ScalarType compute_dtype_ = at::kFloat;
};

} // namespace

std::unique_ptr<Layer> make_lm_head(int64_t dim, int64_t vocab, const std::string &tied_to,
                                    double init_std, int64_t chunk_tokens) {
    return std::make_unique<LmHead>(dim, vocab, tied_to, init_std, chunk_tokens);
}

} // namespace rp
