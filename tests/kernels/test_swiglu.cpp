// rp::kernels::swiglu (src/kernels/swiglu.*) against Hugging Face's `act_fn(gate) * up` under
// autograd: the output and the gradients of gate and up, in fp32, bf16 and fp16, for sizes that
// do and do not fill 16-byte vectors, gate/up as column halves of one fused projection
// (strided) and misaligned storage. RP_TEST_DEVICE=cuda runs the GPU kernels.
#include "kernel_test.h"
#include "kernels/swiglu.h"

namespace {

at::Tensor leaf(const at::Tensor &t) { return t.detach().clone().set_requires_grad(true); }

// fp32: the same fp32 formulas (ATen's silu and silu_backward) up to exp's last bit: 1e-5.
// bf16/fp16: Hugging Face rounds silu(gate) before multiplying by up, and autograd rounds
// dy*up and dy*silu(gate) before the next product, where the kernel rounds once: the two
// differ by up to about one and a half ulps (rtol 2 eps); the absolute term (eps of the
// largest value) covers dgate near the zero of silu' (gate ~ -1.28), where both are small.
kt::Tol tol(at::ScalarType t) {
    if (t == at::kFloat)
        return {1e-5, 1e-6};
    const double eps = t == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
    return {2 * eps, eps};
}

enum class Layout { Contiguous, FusedHalves, Misaligned };

void check(kt::Checker &c, at::ScalarType dtype, c10::Device device, std::vector<int64_t> shape,
           Layout layout) {
    const char *note = layout == Layout::FusedHalves  ? " fused halves"
                       : layout == Layout::Misaligned ? " misaligned"
                                                      : "";
    const std::string name = "swiglu " + kt::describe(dtype, shape, note);
    // Gates over [-8, 8]: silu's negative tail, its minimum and its linear part.
    at::Tensor g0 = kt::randn(shape, dtype, device, 3.0);
    at::Tensor u0 = kt::randn(shape, dtype, device);
    at::Tensor gy = kt::randn(shape, dtype, device);

    at::Tensor gin, uin;
    if (layout == Layout::FusedHalves) {
        // gate_up_proj's output [.., 2 * hidden] split in two: each half is a strided view.
        at::Tensor both = at::cat({g0, u0}, -1);
        gin = both.narrow(-1, 0, shape.back()).detach().requires_grad_();
        uin = both.narrow(-1, shape.back(), shape.back()).detach().requires_grad_();
    } else if (layout == Layout::Misaligned) {
        gin = kt::misaligned(g0).requires_grad_();
        uin = kt::misaligned(u0).requires_grad_();
    } else {
        gin = leaf(g0);
        uin = leaf(u0);
    }
    at::Tensor y = rp::kernels::swiglu(gin, uin);
    auto grads = torch::autograd::grad({y}, {gin, uin}, {gy});

    at::Tensor gr = leaf(g0), ur = leaf(u0);
    at::Tensor yr = at::silu(gr) * ur;
    auto want = torch::autograd::grad({yr}, {gr, ur}, {gy});

    c.close(name + " y", y, yr, tol(dtype));
    c.close(name + " dgate", grads[0], want[0], tol(dtype));
    c.close(name + " dup", grads[1], want[1], tol(dtype));
}

} // namespace

int main() {
    c10::Device device(c10::kCPU);
    if (!kt::test_device(device))
        return kt::kSkip;
    at::manual_seed(15);
    kt::Checker c;
    // 1, 7 and 8195 elements leave a tail after the 16-byte vectors; 3x5x11 has no vector at
    // all in bf16; the rest are MLP-like.
    const std::vector<std::vector<int64_t>> shapes = {
        {1}, {7}, {3, 5, 11}, {2, 3, 1024}, {4, 8195}, {2, 64, 2816}};
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (const auto &shape : shapes)
            check(c, dtype, device, shape, Layout::Contiguous);
        check(c, dtype, device, {3, 4, 200}, Layout::FusedHalves);
        check(c, dtype, device, {3, 4, 200}, Layout::Misaligned);
        check(c, dtype, device, {5, 13}, Layout::Misaligned);
    }
    return c.finish("test_swiglu");
}
