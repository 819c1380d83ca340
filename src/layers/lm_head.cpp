// The LM head of a causal LM: the projection to the vocabulary, fused with the shifted token
// cross entropy when the tail stage of a training call gives it labels.
#include <algorithm>

#include <torch/csrc/autograd/custom_function.h>

#include "layers/transformer_layers.h"

namespace rp {
namespace {

// Chunks of the fused loss hold at most this many logits (128 MiB in fp32): small next to the
// weights of any model worth pipelining, large enough that each chunk's matmul is efficient.
constexpr int64_t kChunkLogits = int64_t{1} << 25;

// Sum over tokens with a target of cross_entropy(h W^T, target), `chunk` tokens at a time.
// The fused tail stage always back-propagates right after the forward, so the gradients are
// computed in the same pass over the chunks (the logits of a chunk are made once) and scaled by
// the incoming gradient in backward.
class ChunkedCausalLmLoss : public torch::autograd::Function<ChunkedCausalLmLoss> {
  public:
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &h,
                              const at::Tensor &w, const at::Tensor &targets, int64_t chunk,
                              bool want_grad) {
        const int64_t n = h.size(0);
        const bool low_precision = h.scalar_type() != at::kFloat;
        at::Tensor total = at::zeros({}, h.options().dtype(at::kFloat));
        at::Tensor grad_h, grad_w;
        if (want_grad) {
            grad_h = at::empty_like(h);
            // Low-precision weights: accumulate the chunks' contributions in fp32.
            grad_w = at::zeros(w.sizes(), w.options().dtype(at::kFloat));
        }
        for (int64_t start = 0; start < n; start += chunk) {
            const int64_t len = std::min(chunk, n - start);
            at::Tensor hc = h.narrow(0, start, len);
            at::Tensor tc = targets.narrow(0, start, len);
            // Logits in the compute dtype, then fp32, as transformers' loss upcasts them.
            at::Tensor logits = at::linear(hc, w).to(at::kFloat);
            at::Tensor valid = tc.ne(kIgnoreIndex);
            at::Tensor index = at::where(valid, tc, at::zeros_like(tc)).unsqueeze(1);
            at::Tensor validf = valid.to(at::kFloat);
            at::Tensor lse = at::logsumexp(logits, {1});
            at::Tensor picked = logits.gather(1, index).squeeze(1);
            total.add_(((lse - picked) * validf).sum());
            if (!want_grad)
                continue;
            // d(loss)/d(logits) = softmax - one_hot(target), zero for tokens without a target.
            logits.sub_(lse.unsqueeze(1)).exp_();
            logits.scatter_add_(1, index, at::full({len, 1}, -1.0, logits.options()));
            logits.mul_(validf.unsqueeze(1));
            at::Tensor g = logits.to(h.scalar_type());
            logits = at::Tensor();
            grad_h.narrow(0, start, len).copy_(at::mm(g, w));
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
        return total;
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
        grad_w.mul_(g);
        return {grad_h, grad_w.to(w_dtype), at::Tensor(), at::Tensor(), at::Tensor()};
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
    // The fused loss keeps an fp32 [vocab, dim] gradient accumulator and, per chunk, fp32
    // logits, their gradient and a low-precision copy.
    double workspace_bytes() const override {
        return 4.0 * static_cast<double>(vocab_) * static_cast<double>(dim_) +
               3.0 * 4.0 * static_cast<double>(kChunkLogits);
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
        const int64_t chunk =
            chunk_tokens_ > 0 ? chunk_tokens_ : std::max<int64_t>(1, kChunkLogits / vocab_);
        const bool want_grad =
            at::GradMode::is_enabled() && (h.requires_grad() || w.requires_grad());
        return ChunkedCausalLmLoss::apply(h, w, targets, chunk, want_grad);
    }

  private:
    int64_t dim_;
    int64_t vocab_;
    int64_t chunk_tokens_;
};

} // namespace

std::unique_ptr<Layer> make_lm_head(int64_t dim, int64_t vocab, const std::string &tied_to,
                                    double init_std, int64_t chunk_tokens) {
    return std::make_unique<LmHead>(dim, vocab, tied_to, init_std, chunk_tokens);
}

} // namespace rp
