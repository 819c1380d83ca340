// The CUDA kernels of src/kernels/*.cu, compiled as host C++ against the stand-in headers here
// and run on CPU threads, against the ATen twins (which tests/kernels/test_*.cpp check against
// Hugging Face's expressions). It covers the index arithmetic, the vector/scalar paths, tails,
// grid-stride loops over more rows than blocks, group and block reductions and the per-block
// dweight partials on machines without a GPU; speed, memory ordering and real hardware limits
// are the GPU tests' job (RP_TEST_DEVICE=cuda).
#include <torch/csrc/autograd/autograd.h>

#include "../kernel_test.h"
#include "kernels/nonfinite.h"
#include "kernels/nonfinite_cuda.h"
#include "kernels/rms_norm.h"
#include "kernels/rms_norm_cuda.h"
#include "kernels/rope.h"
#include "kernels/rope_cuda.h"
#include "kernels/swiglu.h"
#include "kernels/swiglu_cuda.h"

namespace {

using namespace rp::kernels;

ElemType elem(at::ScalarType t) {
    return t == at::kFloat ? ElemType::F32 : t == at::kBFloat16 ? ElemType::BF16 : ElemType::F16;
}

// Both sides compute the same fp32 math and round at the same points; they differ only in the
// order of the sums (rstd, dweight), which in bf16/fp16 flips a rounding now and then: one ulp
// (rtol eps) plus 2 eps of the largest value for the sums and the cancellation in dx.
kt::Tol tol(at::ScalarType t) {
    if (t == at::kFloat)
        return {1e-5, 1e-5};
    const double eps = t == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
    return {eps, 2 * eps};
}

at::Tensor leaf(const at::Tensor &t) { return t.detach().clone().set_requires_grad(true); }

// Outputs start as NaN: an element a kernel never writes fails the check.
at::Tensor poisoned(at::IntArrayRef shape, at::ScalarType dtype) {
    return at::full(shape, NAN, at::TensorOptions().dtype(dtype));
}

void check_rms_norm(kt::Checker &c, at::ScalarType dt, int64_t rows, int64_t dim, bool add,
                    bool misaligned, int blocks) {
    const std::string name = std::string(add ? "add_rms_norm " : "rms_norm ") +
                             kt::describe(dt, {rows, dim}, misaligned ? " misaligned" : "") + ", " +
                             std::to_string(blocks) + " backward blocks";
    at::Tensor x = kt::randn({rows, dim}, dt, at::kCPU), r = kt::randn({rows, dim}, dt, at::kCPU);
    at::Tensor w = kt::randn({dim}, dt, at::kCPU, 0.1, 1.0);
    at::Tensor gy = kt::randn({rows, dim}, dt, at::kCPU), gs = kt::randn({rows, dim}, dt, at::kCPU);
    if (misaligned) {
        x = kt::misaligned(x);
        r = kt::misaligned(r);
    }
    at::Tensor y = poisoned({rows, dim}, dt), s = poisoned({rows, dim}, dt);
    at::Tensor rstd = poisoned({rows}, at::kFloat);
    cudaError_t err =
        rms_norm_forward_cuda(elem(dt), x.data_ptr(), add ? r.data_ptr() : nullptr, w.data_ptr(),
                              add ? s.data_ptr() : nullptr, y.data_ptr(), rstd.data_ptr<float>(),
                              rows, dim, 1e-6f, nullptr);
    if (err == cudaErrorNotSupported)
        return c.fail(name + ": the kernel refused a row it should cover");
    at::Tensor xr = leaf(x), rr = leaf(r), wr = leaf(w), sr, yr;
    if (add)
        std::tie(sr, yr) = add_rms_norm(xr, rr, wr, 1e-6);
    else
        yr = rms_norm(xr, wr, 1e-6);
    c.close(name + " y", y, yr, tol(dt));
    if (add)
        c.close(name + " sum", s, sr, {0.0, 0.0});
    at::Tensor normed = add ? s : x;
    c.close(name + " rstd", rstd, at::rsqrt(normed.to(at::kFloat).pow(2).mean({-1}) + 1e-6),
            {1e-6, 0.0});

    at::Tensor dx = poisoned({rows, dim}, dt), partial = poisoned({blocks, dim}, at::kFloat);
    err = rms_norm_backward_cuda(elem(dt), gy.data_ptr(), add ? gs.data_ptr() : nullptr,
                                 normed.data_ptr(), w.data_ptr(), rstd.data_ptr<float>(),
                                 dx.data_ptr(), partial.data_ptr<float>(), blocks, rows, dim,
                                 nullptr);
    if (err != cudaSuccess)
        return c.fail(name + ": backward launch failed");
    auto want = add ? torch::autograd::grad({sr, yr}, {xr, wr}, {gs, gy})
                    : torch::autograd::grad({yr}, {xr, wr}, {gy});
    c.close(name + " dx", dx, want[0], tol(dt));
    c.close(name + " dweight", partial.sum(0).to(dt), want[1], tol(dt));
}

void check_swiglu(kt::Checker &c, at::ScalarType dt, int64_t n, bool misaligned, int max_blocks) {
    const std::string name = "swiglu " + kt::describe(dt, {n}, misaligned ? " misaligned" : "") +
                             ", at most " + std::to_string(max_blocks) + " blocks";
    at::Tensor g = kt::randn({n}, dt, at::kCPU, 3.0), u = kt::randn({n}, dt, at::kCPU);
    at::Tensor gy = kt::randn({n}, dt, at::kCPU);
    if (misaligned)
        g = kt::misaligned(g);
    at::Tensor y = poisoned({n}, dt), dg = poisoned({n}, dt), du = poisoned({n}, dt);
    if (swiglu_forward_cuda(elem(dt), g.data_ptr(), u.data_ptr(), y.data_ptr(), n, max_blocks,
                            nullptr) != cudaSuccess ||
        swiglu_backward_cuda(elem(dt), gy.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(),
                             du.data_ptr(), n, max_blocks, nullptr) != cudaSuccess)
        return c.fail(name + ": launch failed");
    at::Tensor gr = leaf(g), ur = leaf(u);
    at::Tensor yr = swiglu(gr, ur);
    auto want = torch::autograd::grad({yr}, {gr, ur}, {gy});
    c.close(name + " y", y, yr, tol(dt));
    c.close(name + " dgate", dg, want[0], tol(dt));
    c.close(name + " dup", du, want[1], tol(dt));
}

void check_rope(kt::Checker &c, at::ScalarType dt, std::vector<int64_t> shape, bool per_batch,
                bool norm, bool misaligned, int blocks, bool supported = true) {
    const int64_t b = shape[0], t = shape[1], heads = shape[2], d = shape[3];
    const std::string name = std::string(norm ? "rope+qk_norm " : "rope ") +
                             kt::describe(dt, shape, misaligned ? " misaligned" : "") +
                             (per_batch ? " per-batch tables, " : ", ") + std::to_string(blocks) +
                             " backward blocks";
    const int64_t cb = per_batch ? b : 1;
    at::Tensor pos = at::arange(t, at::kLong).unsqueeze(0).repeat({cb, 1}) +
                     at::arange(cb, at::kLong).unsqueeze(1) * 3;
    at::Tensor inv =
        at::pow(1e4, at::arange(0, d, 2, at::kFloat) / static_cast<double>(d)).reciprocal();
    at::Tensor freqs = pos.unsqueeze(-1).to(at::kFloat) * inv;
    at::Tensor cos = freqs.cos().to(dt), sin = freqs.sin().to(dt);
    at::Tensor x = kt::randn(shape, dt, at::kCPU), gy = kt::randn(shape, dt, at::kCPU);
    at::Tensor w = kt::randn({d}, dt, at::kCPU, 0.1, 1.0);
    if (misaligned)
        x = kt::misaligned(x);
    const int64_t rows = b * t * heads;
    at::Tensor y = poisoned(shape, dt), rstd = poisoned({rows}, at::kFloat);
    cudaError_t err =
        rope_forward_cuda(elem(dt), x.data_ptr(), norm ? w.data_ptr() : nullptr, cos.data_ptr(),
                          sin.data_ptr(), y.data_ptr(), norm ? rstd.data_ptr<float>() : nullptr,
                          rows, heads, t, cb, d, 1e-6f, nullptr);
    if (!supported) {
        if (err != cudaErrorNotSupported)
            c.fail(name + ": the kernel accepted a head_dim it cannot cover");
        return;
    }
    if (err != cudaSuccess)
        return c.fail(name + ": the kernel refused a head_dim it should cover");
    at::Tensor xr = leaf(x), wr = leaf(w);
    at::Tensor yr = rope(xr, cos, sin, norm ? wr : at::Tensor(), 1e-6);
    c.close(name + " y", y, yr, tol(dt));

    at::Tensor dx = poisoned(shape, dt), partial = poisoned({blocks, d}, at::kFloat);
    err = rope_backward_cuda(
        elem(dt), gy.data_ptr(), x.data_ptr(), norm ? w.data_ptr() : nullptr,
        norm ? rstd.data_ptr<float>() : nullptr, cos.data_ptr(), sin.data_ptr(), dx.data_ptr(),
        norm ? partial.data_ptr<float>() : nullptr, blocks, rows, heads, t, cb, d, nullptr);
    if (err != cudaSuccess)
        return c.fail(name + ": backward launch failed");
    auto want = norm ? torch::autograd::grad({yr}, {xr, wr}, {gy})
                     : torch::autograd::grad({yr}, {xr}, {gy});
    c.close(name + " dx", dx, want[0], tol(dt));
    if (norm)
        c.close(name + " dweight", partial.sum(0).to(dt), want[1], tol(dt));
}

// The non-finite kernel's flag against the ATen twin's, for data with one non-finite element
// at `bad_at` (or none when it is -1), on `blocks` emulated blocks.
void check_nonfinite(kt::Checker &c, at::ScalarType dt, int64_t n, int64_t bad_at, bool misaligned,
                     int blocks) {
    const std::string name = "nonfinite " + kt::describe(dt, {n}, misaligned ? " misaligned" : "") +
                             ", bad at " + std::to_string(bad_at);
    at::Tensor x = kt::randn({n}, dt, at::kCPU);
    if (bad_at >= 0)
        x[bad_at] = bad_at % 2 ? NAN : -INFINITY;
    if (misaligned)
        x = kt::misaligned(x);
    double flag = 0.0;
    if (nonfinite_flag_cuda(elem(dt), x.data_ptr(), n, &flag, blocks, nullptr) != cudaSuccess)
        return c.fail(name + ": launch failed");
    const double want = nonfinite_flag(x).item<double>();
    c.expect(flag == want || (std::isinf(flag) && std::isinf(want)),
             name + ": flag " + std::to_string(flag) + ", the twin's " + std::to_string(want));
}

} // namespace

int main() {
    at::manual_seed(15);
    kt::Checker c;
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
        // Rows: one thread-vector each (8), no vector (33), several vectors per thread and the
        // 1024-thread plan (12288 in fp32 is 3072 vectors); 5 rows over 3 blocks (grid-stride).
        for (int64_t dim : {8, 33, 128, 1000, 2048, 4100, 8192, 12288})
            for (bool add : {false, true})
                check_rms_norm(c, dt, 5, dim, add, false, 3);
        check_rms_norm(c, dt, 7, 1024, true, true, 2);
        check_rms_norm(c, dt, 3, 512, false, true, 5); // more blocks than rows: zero partials
        for (int64_t n : {1, 7, 8, 9, 1000, 8195})
            check_swiglu(c, dt, n, false, 2);
        check_swiglu(c, dt, 1001, true, 3);
        // Several vectors per thread over 2 blocks, a tail, the scalar path.
        for (int64_t bad_at : {int64_t{-1}, int64_t{0}, int64_t{5000}, int64_t{8194}})
            check_nonfinite(c, dt, 8195, bad_at, false, 2);
        check_nonfinite(c, dt, 8195, 8193, true, 3);
        check_nonfinite(c, dt, 7, 6, false, 1);
        check_rope(c, dt, {2, 5, 3, 128}, false, true, false, 2);
        check_rope(c, dt, {2, 5, 3, 128}, true, true, false, 3);
        check_rope(c, dt, {2, 5, 3, 128}, false, false, false, 1);
        check_rope(c, dt, {1, 33, 16, 128}, true, true, false, 4); // many rows per block
        check_rope(c, dt, {3, 7, 2, 64}, false, true, false, 2);
        check_rope(c, dt, {2, 3, 4, 80}, true, true, false, 2);
        check_rope(c, dt, {1, 4, 2, 96}, false, true, false, 1);
        check_rope(c, dt, {2, 3, 2, 256}, true, true, false, 2);
        check_rope(c, dt, {2, 3, 3, 6}, false, true, false, 2);
        check_rope(c, dt, {1, 2, 1, 2}, false, true, false, 1);
        check_rope(c, dt, {1, 3, 2, 768}, false, true, false, 2); // several vectors per lane
        check_rope(c, dt, {2, 4, 3, 128}, false, true, true, 2);
        check_rope(c, dt, {1, 3, 2, 1030}, false, true, false, 1, /*supported=*/false);
    }
    return c.finish("test_emulated_kernels");
}
