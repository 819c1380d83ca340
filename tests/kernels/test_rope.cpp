// rp::kernels::rope (src/kernels/rope.*) against Hugging Face's unfused expression under
// autograd: per-head RMSNorm (Qwen3's q_norm/k_norm) or none, transpose to [b, heads, t, d],
// q*cos + rotate_half(q)*sin with the full cos/sin tables. Output and the gradients of x and
// the norm weight, fp32/bf16/fp16, head_dims 128 and others (odd halves that fit no vector,
// one past the CUDA kernel's limit), tables per batch or shared, a q cut from a fused QKV
// projection (strided) and misaligned storage. RP_TEST_DEVICE=cuda runs the GPU kernels.
#include "kernel_test.h"
#include "kernels/rope.h"

namespace {

constexpr double kEps = 1e-6;

at::Tensor leaf(const at::Tensor &t) { return t.detach().clone().set_requires_grad(true); }

at::Tensor hf_rms_norm(const at::Tensor &x, const at::Tensor &w) {
    at::Tensor xf = x.to(at::kFloat);
    at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + kEps);
    return w * normed.to(x.scalar_type());
}

at::Tensor rotate_half(const at::Tensor &x) {
    const int64_t half = x.size(-1) / 2;
    return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Qwen3Attention's q path: q_norm on [b, t, h, d], transpose, apply_rotary_pos_emb; returned
// transposed back to x's layout for the comparison.
at::Tensor hf_rope(const at::Tensor &x, const at::Tensor &cos_half, const at::Tensor &sin_half,
                   const at::Tensor &w) {
    at::Tensor q = w.defined() ? hf_rms_norm(x, w) : x;
    q = q.transpose(1, 2);
    at::Tensor cos = at::cat({cos_half, cos_half}, -1).unsqueeze(1);
    at::Tensor sin = at::cat({sin_half, sin_half}, -1).unsqueeze(1);
    return (q * cos + rotate_half(q) * sin).transpose(1, 2);
}

// fp32: the same fp32 products up to the order of a subtraction and rsqrt's last bit: 1e-5.
// bf16/fp16: Hugging Face rounds q*cos and rotate_half(q)*sin before adding them (and autograd
// rounds dy*cos and dy*sin likewise) where the kernel rounds once; the two roundings of the
// terms add up to about an ulp of the larger term, which cancellation can make large next to
// the result: rtol 2 eps plus 4 eps of the tensor's largest value. The norm keeps Hugging
// Face's rounding points, but an fp32 rstd one bit off flips the rounding of a normalised
// element now and then, moving z by an ulp (up to 1.4 eps of max|y|) before the rotation; the
// backward's norm part cancels again.
kt::Tol forward_tol(at::ScalarType t) {
    if (t == at::kFloat)
        return {1e-5, 1e-6};
    const double eps = t == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
    return {2 * eps, 4 * eps};
}
kt::Tol backward_tol(at::ScalarType t) {
    if (t == at::kFloat)
        return {1e-5, 1e-5};
    const double eps = t == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
    return {2 * eps, 4 * eps};
}

enum class Layout { Contiguous, FusedQkv, Misaligned };

struct Case {
    int64_t b, t, heads, head_dim;
    bool per_batch_tables;
    bool norm;
    Layout layout = Layout::Contiguous;
};

void check(kt::Checker &c, at::ScalarType dtype, c10::Device device, const Case &k) {
    const std::vector<int64_t> shape = {k.b, k.t, k.heads, k.head_dim};
    const char *note = k.layout == Layout::FusedQkv     ? " fused qkv"
                       : k.layout == Layout::Misaligned ? " misaligned"
                                                        : "";
    const std::string name = std::string("rope") + (k.norm ? "+qk_norm " : " ") +
                             kt::describe(dtype, shape, note) +
                             (k.per_batch_tables ? " per-batch tables" : "");

    // Hugging Face's tables: positions times the inverse frequencies in fp32, cos and sin in
    // fp32, rounded to the dtype. Per-batch tables get shifted positions (left padding).
    const int64_t cb = k.per_batch_tables ? k.b : 1;
    at::Tensor pos = at::arange(k.t, at::kLong).unsqueeze(0).repeat({cb, 1}) +
                     at::arange(cb, at::kLong).unsqueeze(1) * 3;
    at::Tensor inv = at::pow(1e6, at::arange(0, k.head_dim, 2, at::kFloat) / double(k.head_dim))
                         .reciprocal();
    at::Tensor freqs = pos.unsqueeze(-1).to(at::kFloat) * inv; // [cb, t, half]
    at::Tensor cos = freqs.cos().to(dtype).to(device), sin = freqs.sin().to(dtype).to(device);

    at::Tensor x0 = kt::randn(shape, dtype, device, 1.0, 0.1);
    at::Tensor w0 = k.norm ? kt::randn({k.head_dim}, dtype, device, 0.1, 1.0) : at::Tensor();
    at::Tensor gy = kt::randn(shape, dtype, device);

    at::Tensor xin;
    if (k.layout == Layout::FusedQkv) {
        // q as the first heads of a [b, t, (heads + 2) * d] projection, viewed per head.
        at::Tensor qkv = kt::randn({k.b, k.t, (k.heads + 2) * k.head_dim}, dtype, device);
        qkv.narrow(-1, 0, k.heads * k.head_dim).copy_(x0.reshape({k.b, k.t, -1}));
        xin = qkv.narrow(-1, 0, k.heads * k.head_dim).view(shape).detach().requires_grad_();
    } else if (k.layout == Layout::Misaligned) {
        xin = kt::misaligned(x0).requires_grad_();
    } else {
        xin = leaf(x0);
    }
    at::Tensor w = k.norm ? leaf(w0) : at::Tensor();
    at::Tensor y = rp::kernels::rope(xin, cos, sin, w, kEps);
    auto grads = k.norm ? torch::autograd::grad({y}, {xin, w}, {gy})
                        : torch::autograd::grad({y}, {xin}, {gy});

    at::Tensor xr = leaf(x0), wr = k.norm ? leaf(w0) : at::Tensor();
    at::Tensor yr = hf_rope(xr, cos, sin, wr);
    auto want = k.norm ? torch::autograd::grad({yr}, {xr, wr}, {gy})
                       : torch::autograd::grad({yr}, {xr}, {gy});

    c.close(name + " y", y, yr, forward_tol(dtype));
    c.close(name + " dx", grads[0], want[0], backward_tol(dtype));
    if (k.norm)
        c.close(name + " dweight", grads[1], want[1], backward_tol(dtype));
}

} // namespace

int main() {
    c10::Device device(c10::kCPU);
    if (!kt::test_device(device))
        return kt::kSkip;
    at::manual_seed(15);
    kt::Checker c;
    const std::vector<Case> cases = {
        {2, 5, 3, 128, false, true},   // Qwen3: q_norm + rope, shared tables
        {2, 5, 3, 128, true, true},    // tables per batch (position ids per sequence)
        {2, 5, 3, 128, false, false},  // Llama: rope only
        {1, 33, 16, 128, true, false}, // many rows: several per warp, several warps
        {3, 7, 2, 64, false, true},
        {2, 3, 4, 80, true, true},     // half 40: five bf16 vectors per half
        {1, 4, 2, 96, false, true},
        {2, 3, 2, 256, true, true},
        {2, 3, 3, 6, false, true},     // half 3: no vector fits
        {1, 2, 1, 2, false, true},
        {1, 3, 2, 1030, false, true},  // past the CUDA kernel's 1024: the ATen twin
        {2, 4, 3, 128, false, true, Layout::FusedQkv},
        {2, 4, 3, 128, true, false, Layout::FusedQkv},
        {2, 4, 3, 128, false, true, Layout::Misaligned},
    };
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf})
        for (const Case &k : cases)
            check(c, dtype, device, k);
    return c.finish("test_rope");
}
