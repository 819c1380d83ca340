#include "baseline.h"

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Reduction.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>

#include "memory.h"
#include "tokens.h"
#include "util.h"

namespace tb {
namespace {

// GPU helpers that need no CUDA headers (the allocator and hooks interfaces of c10/ATen).
void device_synchronize(const at::Device &dev) {
    if (dev.is_cuda())
        at::detail::getCUDAHooks().deviceSynchronize(dev.index());
}
void empty_cuda_cache() {
    if (at::hasCUDA())
        c10::getDeviceAllocator(c10::kCUDA)->emptyCache();
}
int64_t cuda_total_bytes(int device) {
    try {
        return static_cast<int64_t>(
            c10::getDeviceAllocator(c10::kCUDA)->getMemoryInfo(static_cast<c10::DeviceIndex>(device))
                .second);
    } catch (const std::exception &) {
        return -1;
    }
}

struct BaselineLayer {
    at::Tensor q, k, v, o, q_norm, k_norm, gate, up, down, in_norm, post_norm;
};

struct BaselineModel {
    Shape s;
    at::Device dev;
    at::Tensor embed, final_norm, lm_head;
    std::vector<BaselineLayer> layers;
    std::vector<at::Tensor> params, exp_avg, exp_avg_sq, steps;
    at::Tensor cos, sin; // [1, 1, seq, head_dim], fp32

    BaselineModel(const Shape &shape, at::Device device, uint64_t seed) : s(shape), dev(device) {
        at::manual_seed(seed);
        embed = normal({s.vocab, s.hidden});
        for (int64_t l = 0; l < s.layers; ++l)
            layers.push_back(make_layer());
        final_norm = ones({s.hidden});
        lm_head = s.tied ? embed : normal({s.vocab, s.hidden});
        auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
        for (at::Tensor &p : params) {
            p.requires_grad_(true);
            exp_avg.push_back(at::zeros_like(p));
            exp_avg_sq.push_back(at::zeros_like(p));
            // Fused AdamW reads the step count from a float tensor on the parameters' device.
            steps.push_back(at::zeros({}, f32));
        }
    }

    at::Tensor normal(std::vector<int64_t> sz) {
        auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
        at::Tensor t = at::empty(sz, f32).normal_(0.0, 0.02);
        params.push_back(t);
        return t;
    }
    at::Tensor ones(std::vector<int64_t> sz) {
        at::Tensor t = at::ones(sz, at::TensorOptions().dtype(at::kFloat).device(dev));
        params.push_back(t);
        return t;
    }

    BaselineLayer make_layer() {
        const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
        BaselineLayer b;
        b.q = normal({q, s.hidden});
        b.k = normal({kv, s.hidden});
        b.v = normal({kv, s.hidden});
        b.o = normal({s.hidden, q});
        b.q_norm = ones({s.head_dim});
        b.k_norm = ones({s.head_dim});
        b.gate = normal({s.intermediate, s.hidden});
        b.up = normal({s.intermediate, s.hidden});
        b.down = normal({s.hidden, s.intermediate});
        b.in_norm = ones({s.hidden});
        b.post_norm = ones({s.hidden});
        return b;
    }

    int64_t num_params() const {
        int64_t n = 0;
        for (const at::Tensor &p : params)
            n += p.numel();
        return n;
    }

    static at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &w, double eps) {
        at::Tensor xf = x.to(at::kFloat);
        at::Tensor n = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
        return w * n.to(x.scalar_type());
    }
    static at::Tensor rotate_half(const at::Tensor &x) {
        const int64_t h = x.size(-1) / 2;
        return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
    }

    void make_rotary(int64_t seq) {
        if (cos.defined() && cos.size(2) == seq)
            return;
        auto f32 = at::TensorOptions().dtype(at::kFloat);
        at::Tensor inv = at::pow(1000000.0, at::arange(0, s.head_dim, 2, f32) / double(s.head_dim))
                             .reciprocal();
        at::Tensor freqs = at::arange(seq, f32).unsqueeze(1) * inv.unsqueeze(0);
        at::Tensor emb = at::cat({freqs, freqs}, -1).view({1, 1, seq, s.head_dim}).to(dev);
        cos = emb.cos();
        sin = emb.sin();
    }

    at::Tensor decoder_layer(const BaselineLayer &L, const at::Tensor &x_in) const {
        const int64_t b = x_in.size(0), t = x_in.size(1);
        const double eps = 1e-6;
        at::Tensor x = x_in;
        at::Tensor h = rms_norm(x, L.in_norm, eps);
        at::Tensor q = at::linear(h, L.q).view({b, t, s.heads, s.head_dim});
        at::Tensor k = at::linear(h, L.k).view({b, t, s.kv_heads, s.head_dim});
        at::Tensor v = at::linear(h, L.v).view({b, t, s.kv_heads, s.head_dim});
        q = rms_norm(q, L.q_norm, eps).transpose(1, 2);
        k = rms_norm(k, L.k_norm, eps).transpose(1, 2);
        v = v.transpose(1, 2);
        at::Tensor c = cos.to(q.scalar_type()), sn = sin.to(q.scalar_type());
        q = q * c + rotate_half(q) * sn;
        k = k * c + rotate_half(k) * sn;
        at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true,
                                                        std::nullopt, /*enable_gqa=*/true);
        a = a.transpose(1, 2).reshape({b, t, s.heads * s.head_dim});
        x = x + at::linear(a, L.o);
        h = rms_norm(x, L.post_norm, eps);
        return x + at::linear(at::silu(at::linear(h, L.gate)) * at::linear(h, L.up), L.down);
    }

    at::Tensor loss(const at::Tensor &ids) {
        const int64_t b = ids.size(0), t = ids.size(1);
        make_rotary(t);
        at::Tensor x = at::embedding(embed, ids);
        for (const BaselineLayer &L : layers)
            x = decoder_layer(L, x);
        x = rms_norm(x, final_norm, 1e-6);
        // Hugging Face: full logits, upcast to fp32, token i scored against token i + 1.
        at::Tensor logits = at::linear(x, lm_head).to(at::kFloat);
        at::Tensor targets =
            at::cat({ids.narrow(1, 1, t - 1), at::full({b, 1}, -100, ids.options())}, 1);
        return at::cross_entropy_loss(logits.view({b * t, s.vocab}), targets.view({b * t}), {},
                                      at::Reduction::Mean, -100);
    }

    // The loss of one microbatch, its forward under autocast when asked (as inside
    // torch.autocast: backward runs outside it, and the weight casts go when it ends).
    at::Tensor microbatch_loss(const at::Tensor &ids, at::ScalarType autocast_dtype) {
        const bool autocast = dev.is_cuda() && autocast_dtype != at::kFloat;
        if (!autocast)
            return loss(ids);
        at::autocast::set_autocast_dtype(at::kCUDA, autocast_dtype);
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        at::Tensor l;
        try {
            l = loss(ids);
        } catch (...) {
            at::autocast::set_autocast_enabled(at::kCUDA, false);
            at::autocast::clear_cache();
            throw;
        }
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
        return l;
    }

    // One optimizer step over the batch, split along dim 0 into `microbatches` pieces whose
    // gradients accumulate (each piece's mean loss weighted by its share of the batch).
    // Returns the mean loss of the batch.
    double train_step(const at::Tensor &ids, int64_t microbatches, at::ScalarType autocast_dtype,
                      double lr, double wd) {
        const int64_t b = ids.size(0), per = (b + microbatches - 1) / microbatches;
        at::Tensor total = at::zeros({}, ids.options().dtype(at::kFloat));
        for (int64_t start = 0; start < b; start += per) {
            const int64_t len = std::min(per, b - start);
            at::Tensor l = microbatch_loss(ids.narrow(0, start, len), autocast_dtype) *
                           (static_cast<double>(len) / b);
            l.backward();
            total.add_(l.detach());
        }
        std::vector<at::Tensor> grads;
        for (at::Tensor &p : params)
            grads.push_back(p.grad());
        {
            at::NoGradGuard no_grad;
            at::_foreach_add_(steps, 1.0);
            at::_fused_adamw_(params, grads, exp_avg, exp_avg_sq, {}, steps, lr, 0.9, 0.999, wd,
                              1e-8, /*amsgrad=*/false, /*maximize=*/false);
        }
        for (at::Tensor &p : params)
            p.mutable_grad().reset(); // zero_grad(set_to_none=True)
        return total.item<double>();  // waits for the step's GPU work
    }
};

// Rough bytes the baseline needs on one GPU: fp32 weights, gradients and two moments
// (16 bytes/parameter); for one microbatch, the logits (bf16, their fp32 copy, the saved
// log-softmax and two fp32 gradients: 18 bytes per logit) and, per layer and token, about
// 40 x hidden + 8 x intermediate bytes of saved activations (fp32 residual stream and norm
// inputs, bf16 casts, attention and MLP intermediates). Only used to skip runs that cannot fit;
// a run that might fit is tried.
double baseline_bytes_estimate(const Shape &s, int64_t microbatch_tokens) {
    const double p = static_cast<double>(total_params(s));
    const double t = static_cast<double>(microbatch_tokens);
    const double logits = t * s.vocab * 18.0;
    const double acts = t * s.layers * (40.0 * s.hidden + 8.0 * s.intermediate);
    return 16.0 * p + logits + acts;
}

at::ScalarType autocast_dtype(const Options &o) {
    return o.dtype == "bf16" ? at::kBFloat16 : o.dtype == "f16" ? at::kHalf : at::kFloat;
}

// Warm-up and timed steps on a built model; fills the ok fields of `r`.
void train_and_time(BaselineResult &r, BaselineModel &b, const Options &o, int num_gpus) {
    const at::ScalarType ac = autocast_dtype(o);
    const int steps = o.baseline_steps > 0 ? o.baseline_steps : o.steps;
    TokenStream stream = token_stream(o.seed, b.s.vocab);
    std::vector<int64_t> host_ids(static_cast<size_t>(o.tokens()));
    std::vector<double> losses;
    auto step = [&] {
        stream.fill(host_ids);
        at::Tensor ids = at::from_blob(host_ids.data(), {o.batch, o.seq}, at::kLong).to(b.dev);
        losses.push_back(b.train_step(ids, r.microbatches, ac, o.lr, o.weight_decay));
        return losses.back();
    };
    for (int i = 0; i < o.baseline_warmup; ++i) {
        auto t0 = Clock::now();
        double l = step();
        progress("baseline warm-up " + std::to_string(i + 1) + "/" +
                 std::to_string(o.baseline_warmup) + ": " + std::to_string(ms_since(t0)) +
                 " ms, loss " + std::to_string(l));
    }
    device_synchronize(b.dev);
    auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) {
        auto ti = Clock::now();
        double l = step();
        progress("baseline step " + std::to_string(i + 1) + "/" + std::to_string(steps) + ": " +
                 std::to_string(ms_since(ti)) + " ms, loss " + std::to_string(l));
    }
    device_synchronize(b.dev);
    const double total_ms = ms_since(t0);
    r.status = "ok";
    r.mode = b.dev.is_cuda() && ac != at::kFloat
                 ? std::string("fp32 weights, ") + o.dtype +
                       " autocast, fused AdamW, no checkpointing, gradient accumulation over the "
                       "microbatches"
                 : "fp32, fused AdamW, no checkpointing, gradient accumulation over the "
                   "microbatches";
    r.steps = steps;
    r.iter_ms = round_to(total_ms / steps, 3);
    r.tokens_per_s = round_to(o.tokens() * steps / (total_ms / 1000.0), 1);
    r.has_peak = true;
    r.peak_gpu_bytes = b.dev.is_cuda() ? gpu_peak(num_gpus) : -1;
    r.loss_first = losses.front();
    r.loss_last = losses.back();
}

} // namespace

BaselineResult run_baseline(const Options &o, int num_gpus) {
    BaselineResult r;
    const Shape &s = o.model_shape();
    const at::Device dev = o.on_gpu() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    r.microbatches = std::max<int64_t>(
        1, std::min(o.baseline_microbatches > 0 ? o.baseline_microbatches : o.microbatches,
                    o.batch));
    if (dev.is_cuda()) {
        const int64_t total = cuda_total_bytes(0);
        const double need = baseline_bytes_estimate(s, (o.batch + r.microbatches - 1) /
                                                           r.microbatches * o.seq);
        r.bytes_estimate = need;
        if (total > 0 && need > 1.05 * static_cast<double>(total)) {
            r.status = "skipped: needs about " + std::to_string(need / 1073741824.0) +
                       " GiB on the GPU, which has " + std::to_string(total / 1073741824.0) +
                       " GiB";
            return r;
        }
    }
    try {
        if (dev.is_cuda()) {
            empty_cuda_cache();
            gpu_reset_peak(num_gpus);
        }
        progress("baseline: building the plain libtorch model on " + dev.str());
        BaselineModel b(s, dev, o.seed);
        r.params = b.num_params();
        train_and_time(r, b, o, num_gpus);
    } catch (const c10::OutOfMemoryError &e) {
        r.status = std::string("out of memory: ") + e.what_without_backtrace();
        r.has_peak = true;
        r.peak_gpu_bytes = dev.is_cuda() ? gpu_peak(num_gpus) : -1;
    } catch (const c10::Error &e) {
        r.status = std::string("error: ") + e.what_without_backtrace();
    } catch (const std::exception &e) {
        r.status = std::string("error: ") + e.what();
    }
    if (dev.is_cuda()) {
        device_synchronize(dev);
        empty_cuda_cache(); // give the GPU back before RoundPipe measures its free memory
    }
    return r;
}

} // namespace tb
