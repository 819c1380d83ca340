// kernels_bench: the fused kernels of src/kernels/ against the unfused ATen expressions they
// replace in the decoder layer (Hugging Face's), forward alone and forward + backward, on one
// device. Prints one JSON line per kernel: milliseconds per call of each and the speedup.
//
//   kernels_bench --device cuda --dtype bf16 --tokens 8192 --dim 4096 --hidden 12288
//                 --heads 32 --head-dim 128 --reps 20
//
// Defaults: a Llama-8B-sized layer over 8192 tokens. On a GPU the kernels and ATen run on the
// current stream; each timing ends with a synchronising read.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace {

struct Options {
    std::string device = "cuda";
    std::string dtype = "bf16";
    int64_t tokens = 8192, dim = 4096, hidden = 12288, heads = 32, head_dim = 128;
    int reps = 20;
};

Options parse(int argc, char **argv) {
    Options o;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string k = argv[i], v = argv[i + 1];
        if (k == "--device")
            o.device = v;
        else if (k == "--dtype")
            o.dtype = v;
        else if (k == "--tokens")
            o.tokens = std::atoll(v.c_str());
        else if (k == "--dim")
            o.dim = std::atoll(v.c_str());
        else if (k == "--hidden")
            o.hidden = std::atoll(v.c_str());
        else if (k == "--heads")
            o.heads = std::atoll(v.c_str());
        else if (k == "--head-dim")
            o.head_dim = std::atoll(v.c_str());
        else if (k == "--reps")
            o.reps = std::atoi(v.c_str());
        else {
            std::fprintf(stderr, "kernels_bench: unknown option %s\n", k.c_str());
            std::exit(2);
        }
    }
    return o;
}

// Milliseconds per call of f, after two warm-up calls; the read of a scalar at the end waits
// for the device.
double time_ms(const std::function<at::Tensor()> &f, int reps) {
    for (int i = 0; i < 2; ++i)
        f().sum().item<float>();
    const auto start = std::chrono::steady_clock::now();
    at::Tensor last;
    for (int i = 0; i < reps; ++i)
        last = f();
    last.sum().item<float>();
    const std::chrono::duration<double, std::milli> d = std::chrono::steady_clock::now() - start;
    return d.count() / reps;
}

at::Tensor hf_rms_norm(const at::Tensor &x, const at::Tensor &w) {
    at::Tensor xf = x.to(at::kFloat);
    return w * (xf * at::rsqrt(xf.pow(2).mean({-1}, true) + 1e-6)).to(x.scalar_type());
}

at::Tensor rotate_half(const at::Tensor &x) {
    const int64_t half = x.size(-1) / 2;
    return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// One kernel's line: forward (no grad) and forward + backward of each version; `fwd(fused)`
// returns the outputs summed into one tensor, `inputs` the tensors to differentiate.
void report(const char *name, const Options &o,
            const std::function<at::Tensor(bool fused)> &forward,
            const std::vector<at::Tensor> &inputs) {
    double ms[2][2];
    for (int fused = 0; fused < 2; ++fused) {
        {
            c10::AutoGradMode grad_off(false); // forward stages run without grad
            ms[fused][0] = time_ms([&] { return forward(fused); }, o.reps);
        }
        ms[fused][1] = time_ms(
            [&] {
                at::Tensor y = forward(fused);
                auto g = torch::autograd::grad({y}, inputs, {at::ones_like(y)});
                return g[0];
            },
            o.reps);
    }
    std::printf("{\"kernel\": \"%s\", \"device\": \"%s\", \"dtype\": \"%s\", \"tokens\": %lld, "
                "\"unfused_fwd_ms\": %.4f, \"fused_fwd_ms\": %.4f, \"fwd_speedup\": %.2f, "
                "\"unfused_fwd_bwd_ms\": %.4f, \"fused_fwd_bwd_ms\": %.4f, "
                "\"fwd_bwd_speedup\": %.2f}\n",
                name, o.device.c_str(), o.dtype.c_str(), static_cast<long long>(o.tokens), ms[0][0],
                ms[1][0], ms[0][0] / ms[1][0], ms[0][1], ms[1][1], ms[0][1] / ms[1][1]);
    std::fflush(stdout);
}

} // namespace

int main(int argc, char **argv) {
    const Options o = parse(argc, argv);
    const at::ScalarType dt = o.dtype == "fp32"   ? at::kFloat
                              : o.dtype == "fp16" ? at::kHalf
                                                  : at::kBFloat16;
    const c10::Device dev(o.device);
    const auto opts = at::TensorOptions().dtype(dt).device(dev);
    auto param = [&](at::IntArrayRef shape, double shift) {
        return (at::randn(shape, opts) * 0.1 + shift).requires_grad_();
    };

    {
        at::Tensor x = param({o.tokens, o.dim}, 0), w = param({o.dim}, 1);
        report("rms_norm", o,
               [&](bool f) { return f ? rp::kernels::rms_norm(x, w, 1e-6) : hf_rms_norm(x, w); },
               {x, w});
        at::Tensor r = param({o.tokens, o.dim}, 0);
        report("add_rms_norm", o,
               [&](bool f) {
                   if (f) {
                       auto [s, y] = rp::kernels::add_rms_norm(x, r, w, 1e-6);
                       return s + y;
                   }
                   at::Tensor s = x + r;
                   return s + hf_rms_norm(s, w);
               },
               {x, r, w});
    }
    {
        const int64_t half = o.head_dim / 2;
        at::Tensor q = param({1, o.tokens, o.heads, o.head_dim}, 0), w = param({o.head_dim}, 1);
        at::Tensor freqs = at::arange(o.tokens, opts.dtype(at::kFloat)).unsqueeze(-1) *
                           at::arange(half, opts.dtype(at::kFloat)).mul(-0.1).exp();
        at::Tensor cos = freqs.cos().to(dt).unsqueeze(0), sin = freqs.sin().to(dt).unsqueeze(0);
        at::Tensor cos_full = at::cat({cos, cos}, -1).unsqueeze(1);
        at::Tensor sin_full = at::cat({sin, sin}, -1).unsqueeze(1);
        report("qk_norm_rope", o,
               [&](bool f) {
                   if (f)
                       return rp::kernels::rope(q, cos, sin, w, 1e-6).transpose(1, 2);
                   at::Tensor z = hf_rms_norm(q, w).transpose(1, 2);
                   return z * cos_full + rotate_half(z) * sin_full;
               },
               {q, w});
    }
    {
        at::Tensor g = param({o.tokens, o.hidden}, 0), u = param({o.tokens, o.hidden}, 0);
        report("swiglu", o, [&](bool f) { return f ? rp::kernels::swiglu(g, u) : at::silu(g) * u; },
               {g, u});
    }
    return 0;
}
