// rp::kernels::rms_norm and add_rms_norm (src/kernels/rms_norm.*) against Hugging Face's
// unfused expression under autograd: outputs and the gradients of x, residual and weight, in
// fp32, bf16 and fp16, for row lengths that do and do not fill 16-byte vectors, strided and
// misaligned inputs. RP_TEST_DEVICE=cuda runs it on the GPU kernels, otherwise the CPU twin.
#include "kernel_test.h"
#include "kernels/rms_norm.h"

namespace {

constexpr double kEps = 1e-6;

// LlamaRMSNorm.forward, written as transformers writes it.
at::Tensor hf_rms_norm(const at::Tensor &x, const at::Tensor &w) {
    at::Tensor xf = x.to(at::kFloat);
    at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + kEps);
    return w * normed.to(x.scalar_type());
}

at::Tensor leaf(const at::Tensor &t) { return t.detach().clone().set_requires_grad(true); }

// fp32: both sides compute the same fp32 expression up to summation order and rsqrt's last
// bit, so 1e-5 (about 80 ulps) is generous yet catches any wrong term. bf16/fp16: the kernel
// keeps Hugging Face's rounding points in the forward, so outputs differ by at most one ulp of
// the dtype where an fp32 rstd that differs in its last bit flips a rounding (rtol = eps). In
// the backward autograd rounds dy*w and each product dy*round(n) to the dtype where the kernel
// stays in fp32, and dx = rstd*(dn - n*mean(dn*n)) cancels: a few ulps of the row's largest
// gradient (atol = 4 eps of max|want|); the weight gradient sums rows of such products.
kt::Tol forward_tol(at::ScalarType t) {
    if (t == at::kFloat)
        return {1e-5, 1e-6};
    const double eps = t == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
    return {eps, eps};
}
kt::Tol backward_tol(at::ScalarType t) {
    if (t == at::kFloat)
        return {1e-5, 1e-5};
    const double eps = t == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
    return {2 * eps, 4 * eps};
}

enum class Layout { Contiguous, Strided, Misaligned };

at::Tensor make_input(at::IntArrayRef shape, at::ScalarType dtype, c10::Device device,
                      Layout layout) {
    at::Tensor t = kt::randn(shape, dtype, device, 1.5, 0.2);
    if (layout == Layout::Strided) {
        // The same values as columns 3.. of a wider tensor: rows are not contiguous.
        std::vector<int64_t> wide(shape.begin(), shape.end());
        wide.back() += 5;
        at::Tensor w = at::zeros(wide, t.options());
        w.narrow(-1, 3, shape.back()).copy_(t);
        return w.narrow(-1, 3, shape.back());
    }
    if (layout == Layout::Misaligned)
        return kt::misaligned(t);
    return t;
}

void check_rms_norm(kt::Checker &c, at::ScalarType dtype, c10::Device device,
                    std::vector<int64_t> shape, Layout layout, const char *note) {
    const std::string name = "rms_norm " + kt::describe(dtype, shape, note);
    const int64_t dim = shape.back();
    at::Tensor x0 = make_input(shape, dtype, device, layout);
    at::Tensor w0 = kt::randn({dim}, dtype, device, 0.1, 1.0);
    at::Tensor gy = kt::randn(shape, dtype, device);

    // Strided/misaligned layouts: the kernel gets the odd view itself (clone() would copy it
    // into fresh, aligned storage).
    at::Tensor xin = layout == Layout::Contiguous ? leaf(x0) : x0.detach().requires_grad_();
    at::Tensor w = leaf(w0);
    at::Tensor y = rp::kernels::rms_norm(xin, w, kEps);
    auto grads = torch::autograd::grad({y}, {xin, w}, {gy});

    at::Tensor xr = leaf(x0), wr = leaf(w0);
    at::Tensor yr = hf_rms_norm(xr, wr);
    auto want = torch::autograd::grad({yr}, {xr, wr}, {gy});

    c.close(name + " y", y, yr, forward_tol(dtype));
    c.close(name + " dx", grads[0], want[0], backward_tol(dtype));
    c.close(name + " dweight", grads[1], want[1], backward_tol(dtype));
}

void check_add_rms_norm(kt::Checker &c, at::ScalarType dtype, c10::Device device,
                        std::vector<int64_t> shape, Layout layout, bool sum_used,
                        const char *note) {
    const std::string name = std::string("add_rms_norm ") + kt::describe(dtype, shape, note) +
                             (sum_used ? "" : " (sum unused)");
    const int64_t dim = shape.back();
    at::Tensor x0 = make_input(shape, dtype, device, layout);
    at::Tensor r0 = make_input(shape, dtype, device, layout);
    at::Tensor w0 = kt::randn({dim}, dtype, device, 0.1, 1.0);
    at::Tensor gs = kt::randn(shape, dtype, device), gy = kt::randn(shape, dtype, device);

    at::Tensor xin = layout == Layout::Contiguous ? leaf(x0) : x0.detach().requires_grad_();
    at::Tensor rin = layout == Layout::Contiguous ? leaf(r0) : r0.detach().requires_grad_();
    at::Tensor w = leaf(w0);
    auto [s, y] = rp::kernels::add_rms_norm(xin, rin, w, kEps);
    auto grads = sum_used ? torch::autograd::grad({s, y}, {xin, rin, w}, {gs, gy})
                          : torch::autograd::grad({y}, {xin, rin, w}, {gy});

    at::Tensor xr = leaf(x0), rr = leaf(r0), wr = leaf(w0);
    at::Tensor sr = xr + rr;
    at::Tensor yr = hf_rms_norm(sr, wr);
    auto want = sum_used ? torch::autograd::grad({sr, yr}, {xr, rr, wr}, {gs, gy})
                         : torch::autograd::grad({yr}, {xr, rr, wr}, {gy});

    // The sum is one rounding of the same fp32 sum on both sides: equal.
    c.close(name + " sum", s, sr, {0.0, 0.0});
    c.close(name + " y", y, yr, forward_tol(dtype));
    c.close(name + " dx", grads[0], want[0], backward_tol(dtype));
    c.close(name + " dresidual", grads[1], want[1], backward_tol(dtype));
    c.close(name + " dweight", grads[2], want[2], backward_tol(dtype));
}

} // namespace

int main() {
    c10::Device device(c10::kCPU);
    if (!kt::test_device(device))
        return kt::kSkip;
    at::manual_seed(15);
    kt::Checker c;
    // Row lengths: tiny, a head (128), odd (33: no vector fits), 1000 and 4100 (fp32 vectors but
    // not bf16's 8-element ones), the hidden sizes 2048 and 8192, and 12288 (bf16 vectors only:
    // longer rows than one thread-vector plan covers in the scalar path).
    const std::vector<std::vector<int64_t>> shapes = {
        {1, 1, 8}, {2, 3, 128}, {3, 33}, {2, 5, 1000}, {4, 4100}, {2, 3, 2048}, {1, 2, 8192},
        {1, 12288}};
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (const auto &shape : shapes) {
            check_rms_norm(c, dtype, device, shape, Layout::Contiguous, "");
            check_add_rms_norm(c, dtype, device, shape, Layout::Contiguous, true, "");
        }
        check_add_rms_norm(c, dtype, device, {2, 3, 256}, Layout::Contiguous, false, "");
        for (Layout layout : {Layout::Strided, Layout::Misaligned}) {
            const char *note = layout == Layout::Strided ? " strided" : " misaligned";
            check_rms_norm(c, dtype, device, {3, 4, 512}, layout, note);
            check_add_rms_norm(c, dtype, device, {3, 4, 512}, layout, true, note);
        }
    }
    return c.finish("test_rms_norm");
}
