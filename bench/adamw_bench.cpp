// adamw_bench: CPU AdamW over fp32 parameters, on libtorch's intra-op threads.
//   ours        rp::adamw_update (src/optim/adamw_kernel.cpp, compiled into this program)
//   torch       torch::optim::AdamW (libtorch's C++ optimizer: one ATen op per pass)
//   fused       at::_fused_adamw_ (PyTorch's fused CPU kernel, torch.optim.AdamW(fused=True))
//   bf16        rp::adamw_update_bf16_state: the memory-saving mode's kernel (bf16 gradient and
//               moments with stochastic rounding; 18 bytes of traffic per parameter)
//   bf16_publish the same as the memory-saving step runs it in training: the bf16 weight copy
//               written (streamed) and the gradient zeroed in the pass (22 bytes per parameter)
//   bf16_live   the weight copy written but the gradient left alone (20 bytes): a lent download,
//               which goes back to the staging pool and needs no zeroing
//   bf16_pinned bf16_live with the gradient in page-locked memory from libtorch's pinned
//               allocator, where an in-call step reads the downloads (needs CUDA; skipped without)
//   copy        a plain memcpy split over the same threads, for the achievable bytes/s
//   step        the standard mode's step for a bf16 model as three passes: rp::adamw_update,
//               then the bf16 weight copy (a tensor copy of the master) and the gradient zeroed
//   publish     the same in one pass: rp::adamw_update_publish (the engine's step since round 9)
//   widened     the host's whole work on a bf16 model's gradient in the standard mode before
//               round 11: the bf16 download widened into the fp32 gradient buffer (the gradient
//               thread's copy), then publish
//   lent        the same with the download lent: publish reading the bf16 gradient where it
//               landed (no fp32 buffer written, read or zeroed); the weight copy streamed
//   lent_cached lent with the weight copy written by ordinary stores (the engine before
//               streaming stores: each line of the copy is read before it is written)
//   tied_widened a tied embedding's gradient before round 18, each tensor a table of rows 2048
//               wide: the LM-head part (bf16) widened into the fp32 buffer as it lands, the
//               embedding's rows (a fifth of the table, each once) added into it, then publish
//               reading and zeroing the fp32 buffer
//   tied_lent   the same since: the LM-head part lent, the rows added into the zero fp32 buffer
//               and marked, publish reading the bf16 part plus the marked fp32 rows
// and prints one JSON line with times, parameters/s, bytes/s and ratios.
//
//   adamw_bench --params 2.5e8 --tensors 16 --reps 5
//
// AdamW reads parameter, gradient and both moments and writes parameter and moments: 28 bytes
// per parameter. The copy reads and writes each byte once: 2 bytes of traffic per byte copied.
#include "optim/adamw_kernel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
    int64_t params = 250000000;
    int64_t tensors = 16;
    int reps = 5, warmup = 1, threads = 0;
    std::vector<std::string> variants = {"ours",  "fused",   "torch",   "bf16", "bf16_publish", "bf16_live", "bf16_pinned", "copy",
                                         "step",  "publish", "widened", "lent", "lent_cached",
                                         "tied_widened", "tied_lent"};
    std::string label;
};

[[noreturn]] void usage(const char *argv0, const std::string &why) {
    std::fprintf(stderr,
                 "%s\nusage: %s [--params N (e.g. 2.5e8)] [--tensors N] [--reps N] [--warmup N]"
                 " [--threads N]\n  [--variants ours,fused,torch,bf16,bf16_publish,bf16_live,bf16_pinned,copy,step,publish,\n  widened,lent,\n  lent_cached,tied_widened,tied_lent (order"
                 " of the runs)] [--label TEXT]\n",
                 why.c_str(), argv0);
    std::exit(2);
}

Options parse(int argc, char **argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (i + 1 >= argc)
            usage(argv[0], "missing value for " + a);
        std::string v = argv[++i];
        try {
            if (a == "--params") o.params = static_cast<int64_t>(std::stod(v));
            else if (a == "--tensors") o.tensors = std::stoll(v);
            else if (a == "--reps") o.reps = std::stoi(v);
            else if (a == "--warmup") o.warmup = std::stoi(v);
            else if (a == "--threads") o.threads = std::stoi(v);
            else if (a == "--label") o.label = v;
            else if (a == "--variants") {
                o.variants.clear();
                std::stringstream ss(v);
                std::string item;
                while (std::getline(ss, item, ',')) {
                    const Options defaults;
                    if (std::find(defaults.variants.begin(), defaults.variants.end(), item) ==
                        defaults.variants.end())
                        usage(argv[0], "unknown variant '" + item + "'");
                    o.variants.push_back(item);
                }
            }
            else usage(argv[0], "unknown flag " + a);
        } catch (const std::logic_error &) {
            usage(argv[0], "bad value '" + v + "' for " + a);
        }
    }
    if (o.params < 1 || o.tensors < 1 || o.tensors > o.params || o.reps < 1 || o.warmup < 0)
        usage(argv[0], "need params >= tensors >= 1, reps >= 1, warmup >= 0");
    return o;
}

void progress(const std::string &msg) {
    std::fprintf(stderr, "[adamw_bench] %s\n", msg.c_str());
    std::fflush(stderr);
}

struct Timing {
    double median_ms, min_ms;
};

Timing time_it(const char *name, int warmup, int reps, const std::function<void()> &fn) {
    for (int i = 0; i < warmup; ++i)
        fn();
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
        auto t0 = Clock::now();
        fn();
        t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    double med = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
    progress(std::string(name) + ": median " + std::to_string(med) + " ms, min " +
             std::to_string(t.front()) + " ms over " + std::to_string(reps) + " runs");
    return {med, t.front()};
}

constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWd = 1e-2;

// Largest |difference| between our kernel and PyTorch's fused kernel after three steps from the
// same state (odd length, so vector tails are covered).
double check_against_fused() {
    const int64_t n = (1 << 20) + 3;
    at::manual_seed(0);
    at::Tensor p0 = at::randn({n});
    at::Tensor p_ours = p0.clone(), m_ours = at::zeros({n}), v_ours = at::zeros({n});
    at::Tensor p_fused = p0.clone(), m_fused = at::zeros({n}), v_fused = at::zeros({n});
    at::Tensor step = at::zeros({});
    for (int k = 1; k <= 3; ++k) {
        at::Tensor g = at::randn({n});
        rp::adamw_update(p_ours.data_ptr<float>(), g.data_ptr<float>(), m_ours.data_ptr<float>(),
                         v_ours.data_ptr<float>(), n, {kLr, kBeta1, kBeta2, kEps, kWd}, k);
        step.add_(1);
        at::_fused_adamw_({p_fused}, {g}, {m_fused}, {v_fused}, {}, {step}, kLr, kBeta1, kBeta2,
                          kWd, kEps, false, false);
    }
    return (p_ours - p_fused).abs().max().item<double>();
}

// Equal tensors (the last takes the remainder), allocated separately like a model's, and the
// state every variant runs on (the values do not change the work).
struct Arrays {
    std::vector<at::Tensor> P, G, M, V, steps;
};

Arrays make_arrays(const Options &o) {
    Arrays a;
    const int64_t per = o.params / o.tensors;
    for (int64_t i = 0; i < o.tensors; ++i) {
        const int64_t n = i + 1 < o.tensors ? per : o.params - per * (o.tensors - 1);
        // Values of a model in training; filled in parallel (normal_ on the CPU is serial).
        at::Tensor idx = at::arange(n, at::TensorOptions().dtype(at::kFloat));
        a.P.push_back(at::sin(idx).mul_(0.02));
        a.G.push_back(at::cos(idx.mul(0.37)).mul_(1e-3));
        a.M.push_back(at::zeros({n}));
        a.V.push_back(at::zeros({n}));
        a.steps.push_back(at::zeros({}));
    }
    return a;
}

Timing time_ours(const Options &o, Arrays &a) {
    int64_t step = 0;
    return time_it("ours (rp::adamw_update)", o.warmup, o.reps, [&] {
        ++step;
        for (size_t i = 0; i < a.P.size(); ++i)
            rp::adamw_update(a.P[i].data_ptr<float>(), a.G[i].data_ptr<float>(),
                             a.M[i].data_ptr<float>(), a.V[i].data_ptr<float>(), a.P[i].numel(),
                             {kLr, kBeta1, kBeta2, kEps, kWd}, step);
    });
}

Timing time_fused(const Options &o, Arrays &a) {
    return time_it("fused (at::_fused_adamw_)", o.warmup, o.reps, [&] {
        at::_foreach_add_(a.steps, 1.0);
        at::_fused_adamw_(a.P, a.G, a.M, a.V, {}, a.steps, kLr, kBeta1, kBeta2, kWd, kEps, false,
                          false);
    });
}

// torch::optim::AdamW keeps its own moments (allocated on its first step, which is therefore
// always a warm-up).
Timing time_torch_adamw(const Options &o, Arrays &a) {
    std::vector<at::Tensor> leaves;
    for (size_t i = 0; i < a.P.size(); ++i) {
        at::Tensor p = a.P[i].detach().requires_grad_(true);
        p.mutable_grad() = a.G[i];
        leaves.push_back(p);
    }
    torch::optim::AdamW opt(leaves, torch::optim::AdamWOptions(kLr)
                                        .betas(std::make_tuple(kBeta1, kBeta2))
                                        .eps(kEps)
                                        .weight_decay(kWd));
    return time_it("torch::optim::AdamW", std::max(1, o.warmup), o.reps, [&] { opt.step(); });
}

// Its own bf16 gradient and moments, so the fp32 variants' state is untouched.
// `live`: also write a bf16 weight copy; `zero_grad`: zero the gradient as it is read (the
// gradient then stays zero after the first rep: the work per element is the same); `pinned`:
// the gradient in page-locked memory (libtorch's pinned allocator, as the engine's downloads).
Timing time_bf16_state(const Options &o, Arrays &a, bool live = false, bool zero_grad = false,
                       bool pinned = false) {
    if (pinned && !at::hasCUDA()) {
        progress("bf16_pinned: skipped (no CUDA, so no page-locked memory)");
        return {NAN, NAN};
    }
    std::vector<at::Tensor> G16, M16, V16, W16;
    for (const at::Tensor &g : a.G) {
        G16.push_back(pinned ? at::empty(g.sizes(), g.options().dtype(at::kBFloat16).pinned_memory(true))
                                   .copy_(g)
                             : g.to(at::kBFloat16));
        M16.push_back(at::zeros_like(g, at::kBFloat16));
        V16.push_back(at::zeros_like(g, at::kBFloat16));
        W16.push_back(live ? at::zeros_like(g, at::kBFloat16) : at::Tensor());
    }
    auto bits = [](at::Tensor &t) {
        return reinterpret_cast<uint16_t *>(t.data_ptr<at::BFloat16>());
    };
    int64_t step = 0;
    const std::string name = live ? (zero_grad ? "bf16 state, weight copy, gradient zeroed"
                                     : pinned  ? "bf16 state, weight copy, page-locked gradient"
                                               : "bf16 state, weight copy")
                                  : "bf16 state (rp::adamw_update_bf16_state)";
    return time_it(name.c_str(), o.warmup, o.reps, [&] {
        ++step;
        for (size_t i = 0; i < a.P.size(); ++i) {
            rp::GradSpan g;
            g.bf16 = bits(G16[i]);
            rp::adamw_update_bf16_state(a.P[i].data_ptr<float>(), g, bits(M16[i]), bits(V16[i]),
                                        a.P[i].numel(), {kLr, kBeta1, kBeta2, kEps, kWd}, step,
                                        i, live ? bits(W16[i]) : nullptr, zero_grad);
        }
    });
}

// A plain copy of gradient-sized arrays, split over the same threads. It writes into scratch
// arrays of its own, allocated and touched first.
Timing time_copy(const Options &o, Arrays &a) {
    std::vector<at::Tensor> dst;
    for (const at::Tensor &g : a.G)
        dst.push_back(at::zeros_like(g));
    return time_it("memcpy", o.warmup, o.reps, [&] {
        for (size_t i = 0; i < a.G.size(); ++i) {
            const char *src = static_cast<const char *>(a.G[i].data_ptr());
            char *out = static_cast<char *>(dst[i].data_ptr());
            const int64_t bytes = static_cast<int64_t>(a.G[i].nbytes());
            at::parallel_for(0, bytes, int64_t{1} << 20, [&](int64_t b, int64_t e) {
                std::memcpy(out + b, src + b, static_cast<size_t>(e - b));
            });
        }
    });
}

// The standard-mode step of a bf16 model, unfused and fused: each variant writes bf16 weight
// copies of its own and zeroes the gradients (the values do not change the work).
Timing time_standard_step(const Options &o, Arrays &a, bool fused) {
    std::vector<at::Tensor> staged;
    for (const at::Tensor &p : a.P)
        staged.push_back(at::zeros_like(p, at::kBFloat16));
    int64_t step = 0;
    const char *name = fused ? "publish (rp::adamw_update_publish)"
                             : "step (rp::adamw_update, copy to bf16, zero the gradient)";
    return time_it(name, o.warmup, o.reps, [&] {
        ++step;
        for (size_t i = 0; i < a.P.size(); ++i) {
            float *p = a.P[i].data_ptr<float>(), *g = a.G[i].data_ptr<float>();
            float *m = a.M[i].data_ptr<float>(), *v = a.V[i].data_ptr<float>();
            const rp::AdamWHyper h{kLr, kBeta1, kBeta2, kEps, kWd};
            rp::GradSpan grad;
            grad.f32 = g;
            if (fused) {
                rp::adamw_update_publish(p, grad, m, v, a.P[i].numel(), h, step,
                                         reinterpret_cast<uint16_t *>(
                                             staged[i].data_ptr<at::BFloat16>()));
            } else {
                rp::adamw_update(p, g, m, v, a.P[i].numel(), h, step);
                staged[i].copy_(a.P[i]);
                a.G[i].zero_();
            }
        }
    });
}

// A bf16 model's gradient from its download to the end of the standard step: widened into the
// fp32 buffer and then read and zeroed by the step, or lent (the step reads the bf16 download).
Timing time_gradient_path(const Options &o, Arrays &a, bool lent,
                          rp::WeightStores stores = rp::WeightStores::Streaming) {
    std::vector<at::Tensor> staged, downloads;
    for (const at::Tensor &p : a.P) {
        staged.push_back(at::zeros_like(p, at::kBFloat16));
        downloads.push_back(at::randn_like(p).to(at::kBFloat16));
    }
    int64_t step = 0;
    const char *name = !lent ? "widened (download widened into the fp32 gradient, then publish)"
                       : stores == rp::WeightStores::Cached
                           ? "lent_cached (lent, the weight copy by ordinary stores)"
                           : "lent (publish reading the bf16 download)";
    return time_it(name, o.warmup, o.reps, [&] {
        ++step;
        for (size_t i = 0; i < a.P.size(); ++i) {
            const rp::AdamWHyper h{kLr, kBeta1, kBeta2, kEps, kWd};
            rp::GradSpan g;
            if (lent) {
                g.bf16 = reinterpret_cast<uint16_t *>(downloads[i].data_ptr<at::BFloat16>());
            } else {
                a.G[i].copy_(downloads[i]);
                g.f32 = a.G[i].data_ptr<float>();
            }
            rp::adamw_update_publish(a.P[i].data_ptr<float>(), g, a.M[i].data_ptr<float>(),
                                     a.V[i].data_ptr<float>(), a.P[i].numel(), h, step,
                                     reinterpret_cast<uint16_t *>(
                                         staged[i].data_ptr<at::BFloat16>()),
                                     stores);
        }
    });
}

// A tied embedding's host work from its two downloads to the end of the step (see the header).
Timing time_tied_gradient(const Options &o, Arrays &a, bool lent) {
    constexpr int64_t kWidth = 2048;
    std::vector<at::Tensor> staged, lm_parts, row_values, row_ids, marks;
    for (const at::Tensor &p : a.P) {
        const int64_t rows = p.numel() / kWidth, used = rows / 5;
        staged.push_back(at::zeros_like(p, at::kBFloat16));
        lm_parts.push_back(at::randn_like(p).to(at::kBFloat16));
        row_values.push_back(at::randn({used, kWidth}).to(at::kBFloat16));
        row_ids.push_back(at::randperm(rows).narrow(0, 0, used).contiguous());
        marks.push_back(at::zeros({rows}, at::kByte));
    }
    int64_t step = 0;
    const char *name = lent ? "tied_lent (LM-head part lent, rows marked beside it)"
                            : "tied_widened (LM-head part widened as it lands, rows added)";
    return time_it(name, o.warmup, o.reps, [&] {
        ++step;
        for (size_t i = 0; i < a.P.size(); ++i) {
            const int64_t n = a.P[i].numel(), rows = n / kWidth;
            float *g = a.G[i].data_ptr<float>();
            rp::GradSpan span;
            span.f32 = g;
            if (lent) {
                span.bf16 = reinterpret_cast<uint16_t *>(lm_parts[i].data_ptr<at::BFloat16>());
                span.f32_rows = marks[i].data_ptr<uint8_t>();
                span.row_width = kWidth;
            } else {
                a.G[i].copy_(lm_parts[i]);
            }
            const int64_t *id = row_ids[i].data_ptr<int64_t>();
            const auto *v = reinterpret_cast<const uint16_t *>(row_values[i].data_ptr());
            uint8_t *mark = marks[i].data_ptr<uint8_t>();
            rp::add_rows_widened_bf16(v, id, row_values[i].size(0), kWidth, g, 1.0f);
            if (lent)
                for (int64_t r = 0; r < row_values[i].size(0); ++r)
                    mark[id[r]] = 1;
            const rp::AdamWHyper h{kLr, kBeta1, kBeta2, kEps, kWd};
            rp::adamw_update_publish(a.P[i].data_ptr<float>(), span, a.M[i].data_ptr<float>(),
                                     a.V[i].data_ptr<float>(), rows * kWidth, h, step,
                                     reinterpret_cast<uint16_t *>(
                                         staged[i].data_ptr<at::BFloat16>()));
            marks[i].zero_();
        }
    });
}

struct Timings {
    Timing ours{NAN, NAN}, fused{NAN, NAN}, torch_adamw{NAN, NAN}, copy{NAN, NAN}, bf16{NAN, NAN},
        bf16_publish{NAN, NAN}, bf16_live{NAN, NAN}, bf16_pinned{NAN, NAN}, step{NAN, NAN}, publish{NAN, NAN}, widened{NAN, NAN}, lent{NAN, NAN},
        lent_cached{NAN, NAN}, tied_widened{NAN, NAN}, tied_lent{NAN, NAN};
};

void print_report(const Options &o, int threads, const Timings &t, double max_diff) {
    const double n = static_cast<double>(o.params);
    const double adam_bytes = 28.0 * n;
    const double copy_gbps = 2.0 * 4.0 * n / t.copy.median_ms / 1e6;
    std::string label;
    for (char c : o.label)
        if (c != '"' && c != '\\' && static_cast<unsigned char>(c) >= 0x20)
            label += c;
    auto r = [](double v, int d) {
        double f = std::pow(10.0, d);
        return std::round(v * f) / f;
    };
    // A variant that was not run has NaN figures: JSON has no NaN, so the line is printed with
    // "nan" and those values become null.
    auto gparams = [&](const Timing &x) { return r(n / x.median_ms / 1e6, 3); };
    auto gbps = [&](const Timing &x) { return r(adam_bytes / x.median_ms / 1e6, 3); };
    char line[4096];
    std::snprintf(line, sizeof line,
        "{\"bench\":\"adamw\",\"status\":\"%s\",\"label\":\"%s\",\"params\":%lld,\"tensors\":%lld,"
        "\"threads\":%d,\"reps\":%d,"
        "\"ours_ms\":%.3f,\"ours_min_ms\":%.3f,\"ours_gparams_per_s\":%.3f,\"ours_gbps\":%.3f,"
        "\"fused_ms\":%.3f,\"fused_min_ms\":%.3f,\"fused_gparams_per_s\":%.3f,\"fused_gbps\":%.3f,"
        "\"torch_adamw_ms\":%.3f,\"torch_adamw_gparams_per_s\":%.3f,"
        "\"copy_ms\":%.3f,\"copy_gbps\":%.3f,"
        "\"speedup_vs_fused\":%.4f,\"speedup_vs_torch_adamw\":%.4f,"
        "\"ours_fraction_of_copy_bw\":%.4f,\"fused_fraction_of_copy_bw\":%.4f,"
        "\"bf16_state_ms\":%.3f,\"bf16_state_gparams_per_s\":%.3f,"
        "\"bf16_state_speedup_vs_fused\":%.4f,"
        "\"bf16_publish_ms\":%.3f,\"bf16_live_ms\":%.3f,\"bf16_live_speedup_vs_publish\":%.4f,"
        "\"bf16_pinned_ms\":%.3f,\"bf16_pinned_slowdown_vs_live\":%.4f,"
        "\"standard_step_ms\":%.3f,\"publish_ms\":%.3f,\"publish_speedup_vs_step\":%.4f,"
        "\"widened_ms\":%.3f,\"lent_ms\":%.3f,\"lent_speedup_vs_widened\":%.4f,"
        "\"lent_cached_ms\":%.3f,\"streaming_speedup\":%.4f,"
        "\"tied_widened_ms\":%.3f,\"tied_lent_ms\":%.3f,\"tied_lent_speedup\":%.4f,"
        "\"max_abs_diff_vs_fused\":%.3g}\n",
        max_diff <= 1e-5 ? "ok" : "mismatch", label.c_str(), static_cast<long long>(o.params),
        static_cast<long long>(o.tensors), threads, o.reps, t.ours.median_ms, t.ours.min_ms,
        gparams(t.ours), gbps(t.ours), t.fused.median_ms, t.fused.min_ms, gparams(t.fused),
        gbps(t.fused), t.torch_adamw.median_ms, gparams(t.torch_adamw), t.copy.median_ms,
        copy_gbps, t.fused.median_ms / t.ours.median_ms,
        t.torch_adamw.median_ms / t.ours.median_ms, gbps(t.ours) / copy_gbps,
        gbps(t.fused) / copy_gbps, t.bf16.median_ms, gparams(t.bf16),
        t.fused.median_ms / t.bf16.median_ms, t.bf16_publish.median_ms, t.bf16_live.median_ms,
        t.bf16_publish.median_ms / t.bf16_live.median_ms, t.bf16_pinned.median_ms,
        t.bf16_pinned.median_ms / t.bf16_live.median_ms, t.step.median_ms, t.publish.median_ms,
        t.step.median_ms / t.publish.median_ms, t.widened.median_ms, t.lent.median_ms,
        t.widened.median_ms / t.lent.median_ms, t.lent_cached.median_ms,
        t.lent_cached.median_ms / t.lent.median_ms, t.tied_widened.median_ms,
        t.tied_lent.median_ms, t.tied_widened.median_ms / t.tied_lent.median_ms, max_diff);
    std::string text = line;
    for (const char *token : {":-nan", ":nan", ":-inf", ":inf"}) // values only, not the label
        for (size_t at = text.find(token); at != std::string::npos; at = text.find(token))
            text.replace(at, std::strlen(token), ":null");
    std::fputs(text.c_str(), stdout);
}

} // namespace

int main(int argc, char **argv) {
    Options o = parse(argc, argv);
    if (o.threads > 0)
        at::set_num_threads(o.threads);
    const int threads = at::get_num_threads();
    progress("allocating " + std::to_string(o.params) + " parameters in " +
             std::to_string(o.tensors) + " tensors, " + std::to_string(threads) + " threads");
    Arrays a = make_arrays(o);
    // Every variant runs on the same arrays, in the order given by --variants.
    Timings t;
    for (const std::string &variant : o.variants) {
        if (variant == "ours")
            t.ours = time_ours(o, a);
        else if (variant == "fused")
            t.fused = time_fused(o, a);
        else if (variant == "torch")
            t.torch_adamw = time_torch_adamw(o, a);
        else if (variant == "bf16")
            t.bf16 = time_bf16_state(o, a);
        else if (variant == "bf16_publish")
            t.bf16_publish = time_bf16_state(o, a, true, true);
        else if (variant == "bf16_live")
            t.bf16_live = time_bf16_state(o, a, true, false);
        else if (variant == "bf16_pinned")
            t.bf16_pinned = time_bf16_state(o, a, true, false, true);
        else if (variant == "copy")
            t.copy = time_copy(o, a);
        else if (variant == "step")
            t.step = time_standard_step(o, a, false);
        else if (variant == "publish")
            t.publish = time_standard_step(o, a, true);
        else if (variant == "widened")
            t.widened = time_gradient_path(o, a, false);
        else if (variant == "lent")
            t.lent = time_gradient_path(o, a, true);
        else if (variant == "lent_cached")
            t.lent_cached = time_gradient_path(o, a, true, rp::WeightStores::Cached);
        else if (variant == "tied_widened")
            t.tied_widened = time_tied_gradient(o, a, false);
        else if (variant == "tied_lent")
            t.tied_lent = time_tied_gradient(o, a, true);
    }
    const double max_diff = check_against_fused();
    print_report(o, threads, t, max_diff);
    return max_diff <= 1e-5 ? 0 : 1;
}
