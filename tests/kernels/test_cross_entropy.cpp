// kernels/cross_entropy against ATen's unfused expression: the reference is
// at::cross_entropy(logits.to(fp32), targets, reduction none, ignore_index -100) on the CPU and
// the gradient autograd gives for the sum of its losses, which is what transformers' causal-LM
// loss computes (it upcasts the logits) before the backward of the cast rounds the gradient
// back to the model dtype.
//
// Tolerances, by dtype:
// - The loss is fp32 math on the same stored logits for every dtype; only the order of the fp32
//   sum of exps differs from ATen's, which moves log(sum) by an ulp or two: 2e-6 relative to
//   the loss plus 2e-6 absolute (log(sum) of a 151,936-entry row is about 12, ulp 1e-6).
// - The fp32 gradient exp((x - max) - log(sum)) inherits that log(sum) difference through an
//   exp argument of magnitude up to ~36 here (half an ulp there is 2^-19 ~ 1.9e-6): 4e-6
//   relative. At the target, softmax - 1 cancels when the model is confident, so there the
//   error is absolute: the sum of exps is >= 1 and rounds at a few 2^-24 of itself, which moves
//   log(sum), hence p, by as much: 2^-20 absolute (8 half-ulps of 1).
// - bf16 / fp16 gradients are rounded once from that fp32 value: half an ulp, 2^-8 (bf16) or
//   2^-11 (fp16) relative, plus the fp32 difference above (relative and absolute), which may
//   flip a rounding; fp16 adds 2^-24 absolute for its subnormals (probabilities below 6e-5).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "kernels/cross_entropy.h"

namespace {

constexpr int64_t kIgnore = -100;
int failures = 0;

void check(bool ok, const std::string &what) {
    if (!ok) {
        std::fprintf(stderr, "FAIL: %s\n", what.c_str());
        ++failures;
    }
}

struct Tolerance {
    double rtol;
    double atol;
};

// log(sum of exp) over a row of `vocab` logits in fp32: the sum's rounding error grows like a
// random walk, about eps * sqrt(vocab) relative (2 eps sqrt(vocab) allows twice that), and the
// log turns it into the same absolute error in the loss and relative error in every gradient
// element (softmax = exp(x - log sum)). The float64 reference has none of it. ATen's own fp32
// cross entropy on the CPU is off by 1e-5 on 151,936 logits.
double sum_error(int64_t vocab) {
    return 2.0 * std::ldexp(1.0, -24) * std::sqrt(static_cast<double>(std::max<int64_t>(1, vocab)));
}

Tolerance loss_tolerance(int64_t vocab) { return {2e-6, 2e-6 + sum_error(vocab)}; }

Tolerance grad_tolerance(at::ScalarType dtype, int64_t vocab) {
    const double fp32_rtol = 4e-6 + sum_error(vocab), fp32_atol = std::ldexp(1.0, -20);
    switch (dtype) {
    case at::kBFloat16:
        return {std::ldexp(1.0, -8) + fp32_rtol, fp32_atol};
    case at::kHalf:
        return {std::ldexp(1.0, -11) + fp32_rtol, fp32_atol + std::ldexp(1.0, -24)};
    default:
        return {fp32_rtol, fp32_atol};
    }
}

// Largest |got - want| / (atol + rtol |want|); <= 1 passes. NaN anywhere fails.
double worst_ratio(const at::Tensor &got, const at::Tensor &want, Tolerance tol) {
    at::Tensor g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
    if (g.isnan().any().item<bool>() || w.isnan().any().item<bool>())
        return INFINITY;
    at::Tensor ratio = (g - w).abs() / (w.abs() * tol.rtol + tol.atol);
    return ratio.numel() == 0 ? 0.0 : ratio.max().item<double>();
}

struct Reference {
    at::Tensor loss; // [n] fp32
    at::Tensor grad; // [n, vocab] fp32
};

// ATen's cross entropy and its autograd gradient in float64 on the CPU: exact to far below the
// fp32 rounding the kernel is held to, whatever order either sums in.
Reference reference(const at::Tensor &logits, const at::Tensor &targets) {
    at::Tensor x = logits.to(at::kCPU, at::kDouble).detach().requires_grad_(true);
    at::Tensor loss =
        at::cross_entropy_loss(x, targets.to(at::kCPU), {}, at::Reduction::None, kIgnore);
    loss.sum().backward();
    return {loss.detach(), x.grad()};
}

// On a failed loss check: each row's loss, the kernel's against the reference's.
void print_rows(const at::Tensor &got, const at::Tensor &want) {
    at::Tensor g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
    for (int64_t i = 0; i < g.numel(); ++i)
        std::printf("  row %lld: kernel %.9g reference %.9g difference %.3g\n",
                    static_cast<long long>(i), g[i].item<double>(), w[i].item<double>(),
                    g[i].item<double>() - w[i].item<double>());
}

at::Device test_device() {
    const char *env = std::getenv("RP_TEST_DEVICE");
    if (env && std::string(env) == "cuda") {
        if (!at::hasCUDA() || at::getNumGPUs() == 0) {
            std::printf("RP_TEST_DEVICE=cuda but no CUDA device is visible: skipped\n");
            std::exit(77);
        }
        return at::Device(at::kCUDA, 0);
    }
    return at::Device(at::kCPU);
}

std::string name(at::ScalarType dtype, int64_t n, int64_t vocab, const std::string &what) {
    return std::string(c10::toString(dtype)) + " [" + std::to_string(n) + ", " +
           std::to_string(vocab) + "] " + what;
}

// Logits of the given dtype with a spread like a trained LM head's (a few confident tokens),
// targets with some ignored tokens and the vocabulary's first and last ids.
at::Tensor make_logits(int64_t n, int64_t vocab, at::ScalarType dtype, at::Device device,
                       int64_t pad_columns) {
    at::Tensor wide = at::randn({n, vocab + pad_columns}) * 3.0;
    if (vocab > 2)
        wide.select(1, pad_columns).add_(12.0); // a confident token: softmax - 1 cancels
    // Columns shifted by pad_columns: rows start off any 16-byte boundary, stride > vocab.
    return wide.to(device, dtype).narrow(1, pad_columns, vocab);
}

at::Tensor make_targets(int64_t n, int64_t vocab, at::Device device) {
    at::Tensor t = at::randint(0, vocab, {n}, at::kLong);
    for (int64_t i = 0; i < n; i += 3)
        t[i] = kIgnore;
    if (n > 1)
        t[1] = vocab - 1;
    if (n > 2)
        t[2] = 0;
    return t.to(device);
}

void check_case(int64_t n, int64_t vocab, at::ScalarType dtype, at::Device device,
                int64_t pad_columns, at::Tensor targets = at::Tensor()) {
    at::Tensor logits = make_logits(n, vocab, dtype, device, pad_columns);
    if (!targets.defined())
        targets = make_targets(n, vocab, device);
    const Reference ref = reference(logits, targets);
    const std::string what = pad_columns ? "(unaligned rows, stride > vocab)" : "";

    // Loss only: the logits stay as they were.
    at::Tensor before = logits.clone();
    at::Tensor loss_only = rp::kernels::cross_entropy_(logits, targets, kIgnore, false);
    check(at::equal(logits.cpu(), before.cpu()),
          name(dtype, n, vocab, what + " loss only kept the logits"));
    const Tolerance loss_tol = loss_tolerance(vocab);
    check(worst_ratio(loss_only, ref.loss, loss_tol) <= 1.0,
          name(dtype, n, vocab, what + " loss (no gradient) matches at::cross_entropy"));

    at::Tensor loss = rp::kernels::cross_entropy_(logits, targets, kIgnore, true);
    const double lr = worst_ratio(loss, ref.loss, loss_tol);
    if (lr > 1.0)
        print_rows(loss, ref.loss);
    const double gr = worst_ratio(logits, ref.grad, grad_tolerance(dtype, vocab));
    check(lr <= 1.0, name(dtype, n, vocab,
                          what + " loss matches at::cross_entropy, ratio " + std::to_string(lr)));
    check(gr <= 1.0,
          name(dtype, n, vocab, what + " gradient matches autograd, ratio " + std::to_string(gr)));
    check(logits.scalar_type() == dtype, "gradient kept the logits' dtype");
    // Rounded once: for low precision the result equals the rounded fp32 reference almost
    // everywhere (a rounding may only flip where the fp32 values differ in their last bits).
    if (dtype != at::kFloat) {
        // The fp32 gradient rounded once: what the kernel writes, but for a flip at a tie,
        // which a few elements may show however small the case (so never fewer than 2).
        at::Tensor rounded = ref.grad.to(at::kFloat).to(dtype);
        const double flips = logits.cpu().ne(rounded).sum().item<double>();
        const double differ = flips / static_cast<double>(std::max<int64_t>(1, logits.numel()));
        check(flips <= std::max(2.0, 1e-3 * static_cast<double>(logits.numel())),
              name(dtype, n, vocab,
                                   what +
                                       " gradient equals the once-rounded "
                                       "reference except at rare ties, " +
                                       std::to_string(differ) + " differ"));
    }
    std::printf("ok %s: loss ratio %.3f, gradient ratio %.3f\n",
                name(dtype, n, vocab, what).c_str(), lr, gr);
}

void check_all_ignored(at::ScalarType dtype, at::Device device) {
    at::Tensor logits = make_logits(5, 37, dtype, device, 0);
    at::Tensor targets = at::full({5}, kIgnore, at::TensorOptions(at::kLong).device(device));
    at::Tensor loss = rp::kernels::cross_entropy_(logits, targets, kIgnore, true);
    const Reference ref = reference(make_logits(5, 37, dtype, device, 0), targets);
    check(at::equal(loss.cpu(), ref.loss.to(at::kFloat)),
          name(dtype, 5, 37, "all-ignored rows: loss 0"));
    check(at::equal(logits.cpu().to(at::kFloat), ref.grad.to(at::kFloat)),
          name(dtype, 5, 37, "all-ignored rows: gradient 0"));
}

void check_masked_logits(at::Device device) {
    // -inf logits (masked tokens) contribute nothing, as in ATen.
    at::Tensor logits = at::randn({4, 50});
    logits.narrow(1, 10, 20).fill_(-INFINITY);
    logits = logits.to(device);
    at::Tensor targets = at::tensor({3, 45, 0, 9}, at::kLong).to(device);
    const Reference ref = reference(logits, targets);
    at::Tensor loss = rp::kernels::cross_entropy_(logits, targets, kIgnore, true);
    check(worst_ratio(loss, ref.loss, loss_tolerance(50)) <= 1.0, "-inf logits: loss");
    check(worst_ratio(logits, ref.grad, grad_tolerance(at::kFloat, 50)) <= 1.0,
          "-inf logits: grad");
}

void check_bad_target(at::Device device) {
    // A target out of range cannot throw on a GPU: its token's loss and gradient are NaN, the
    // other tokens are unaffected.
    at::Tensor logits = at::randn({3, 20}).to(device);
    at::Tensor targets = at::tensor({1, 20, 2}, at::kLong).to(device);
    at::Tensor loss = rp::kernels::cross_entropy_(logits, targets, kIgnore, true).cpu();
    check(std::isnan(loss[1].item<float>()), "target == vocab gives a NaN loss");
    check(logits.cpu()[1].isnan().all().item<bool>(), "target == vocab gives a NaN gradient");
    check(!loss[0].isnan().item<bool>() && !loss[2].isnan().item<bool>(),
          "a bad target leaves the other rows alone");
}

void check_rejects(at::Device device) {
    auto throws = [](auto &&fn) {
        try {
            fn();
        } catch (const c10::Error &) {
            return true;
        }
        return false;
    };
    at::Tensor t = at::zeros({4}, at::TensorOptions(at::kLong).device(device));
    check(throws([&] {
              // [4, 8] with strides (1, 4)
              at::Tensor y = at::randn({8, 4}, at::TensorOptions().device(device)).t();
              rp::kernels::cross_entropy_(y, t, kIgnore, true);
          }),
          "rejects logits without unit stride along the vocabulary");
    check(
        throws([&] {
            at::Tensor y = at::randn({4, 8}, at::TensorOptions().dtype(at::kDouble).device(device));
            rp::kernels::cross_entropy_(y, t, kIgnore, true);
        }),
        "rejects fp64 logits");
    check(throws([&] {
              at::Tensor y = at::randn({4, 8}, at::TensorOptions().device(device));
              at::Tensor t32 = t.to(at::kInt);
              rp::kernels::cross_entropy_(y, t32, kIgnore, true);
          }),
          "rejects int32 targets");
    at::Tensor empty = at::empty({0, 8}, at::TensorOptions().device(device));
    at::Tensor none = at::empty({0}, at::TensorOptions(at::kLong).device(device));
    check(rp::kernels::cross_entropy_(empty, none, kIgnore, true).numel() == 0,
          "an empty chunk gives an empty loss");
}

// Row offsets past 2^31 elements (a 16k-token chunk of a 151,936 vocabulary): only on a GPU,
// where the index arithmetic is 64-bit by construction; the last rows are checked.
void check_large_offsets(at::Device device) {
    const int64_t vocab = 131075, n = 16400; // n * vocab = 2.15e9 > 2^31
    at::Tensor logits;
    try {
        logits = at::randn({n, vocab}, at::TensorOptions(at::kBFloat16).device(device));
    } catch (const c10::OutOfMemoryError &) {
        std::printf("skipped the 2^31-element case: not enough GPU memory\n");
        return;
    }
    at::Tensor targets = at::randint(0, vocab, {n}, at::TensorOptions(at::kLong).device(device));
    at::Tensor tail = logits.narrow(0, n - 3, 3).clone();
    const Reference ref = reference(tail, targets.narrow(0, n - 3, 3));
    at::Tensor loss = rp::kernels::cross_entropy_(logits, targets, kIgnore, true);
    check(worst_ratio(loss.narrow(0, n - 3, 3), ref.loss, loss_tolerance(vocab)) <= 1.0,
          "rows past 2^31 elements: loss");
    check(worst_ratio(logits.narrow(0, n - 3, 3), ref.grad, grad_tolerance(at::kBFloat16, vocab)) <=
              1.0,
          "rows past 2^31 elements: gradient");
    std::printf("ok bf16 [%lld, %lld]: rows past 2^31 elements\n", static_cast<long long>(n),
                static_cast<long long>(vocab));
}

} // namespace

int main() {
    const at::Device device = test_device();
    at::manual_seed(15);
    std::printf("device: %s\n", device.str().c_str());
    // Vocabulary sizes: a single token, below one 16-byte vector, odd, odd and large, Qwen3's
    // (not a power of two); row counts below and above one warp.
    const std::vector<std::pair<int64_t, int64_t>> shapes = {
        {3, 1}, {5, 3}, {33, 96}, {17, 1001}, {9, 4099}, {40, 8192}, {3, 151936}};
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (const auto &s : shapes)
            check_case(s.first, s.second, dtype, device, 0);
        for (const auto &s : shapes)
            if (s.second > 1)
                check_case(s.first, s.second, dtype, device, 3);
        check_all_ignored(dtype, device);
    }
    check_masked_logits(device);
    check_bad_target(device);
    check_rejects(device);
    if (device.is_cuda())
        check_large_offsets(device);
    if (failures) {
        std::fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    std::printf("all cross_entropy checks passed\n");
    return 0;
}
