// RMSNorm's autograd functions, argument checks, and the ATen twin of rms_norm.cu's kernels.
#include "kernels/rms_norm.h"

#include <algorithm>
#include <climits>

#include <torch/csrc/autograd/custom_function.h>

#include "kernels/dispatch.h"
#ifdef RP_KERNELS_HAVE_CUDA
#include "kernels/rms_norm_cuda.h"
#endif

namespace rp::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_norm_args(const char *name, const at::Tensor &x, const at::Tensor &weight) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) <= INT_MAX, name,
                ": x needs a last dimension of 1 to INT_MAX elements, got ", x.sizes());
    TORCH_CHECK(supported_dtype(x.scalar_type()), name, ": no kernel for dtype ",
                c10::toString(x.scalar_type()), " (float32, bfloat16 and float16 have one)");
    TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight is ",
                c10::toString(weight.scalar_type()), " but x is ",
                c10::toString(x.scalar_type()));
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), name, ": weight must be [",
                x.size(-1), "], got ", weight.sizes());
    TORCH_CHECK(weight.device() == x.device(), name, ": weight is on ", weight.device(),
                " but x is on ", x.device());
}

struct NormForward {
    at::Tensor sum; // residual variant only: x + residual in x's dtype
    at::Tensor y;
    at::Tensor rstd; // fp32, x's shape without its last dimension
};

struct NormBackward {
    at::Tensor dx;
    at::Tensor dweight;
};

// The ATen twin: the kernels' math in ATen operations, on contiguous tensors. The CPU worker
// devices run it (in fp32 it is Hugging Face's expression, operation for operation), and CUDA
// uses it for rows too long for the register-resident kernel.
NormForward forward_aten(const at::Tensor &x, const at::Tensor &residual,
                         const at::Tensor &weight, double eps) {
    NormForward f;
    at::Tensor s = x;
    if (residual.defined())
        s = f.sum = x + residual;
    at::Tensor sf = s.to(at::kFloat);
    f.rstd = at::rsqrt(sf.pow(2).mean({-1}) + eps);
    f.y = weight * (sf * f.rstd.unsqueeze(-1)).to(x.scalar_type());
    return f;
}

NormBackward backward_aten(const at::Tensor &dy, const at::Tensor &dsum, const at::Tensor &x,
                           const at::Tensor &weight, const at::Tensor &rstd) {
    const int64_t dim = x.size(-1);
    at::Tensor r = rstd.unsqueeze(-1);
    at::Tensor n = x.to(at::kFloat) * r;
    at::Tensor dyf = dy.to(at::kFloat);
    at::Tensor dn = dyf * weight.to(at::kFloat);
    at::Tensor dx = r * (dn - n * (dn * n).mean({-1}, true));
    if (dsum.defined())
        dx = dx + dsum.to(at::kFloat);
    // The weight multiplied the normalised row after its rounding to x's dtype.
    at::Tensor dw = (dyf * n.to(x.scalar_type()).to(at::kFloat)).reshape({-1, dim}).sum(0);
    return {dx.to(x.scalar_type()), dw.to(weight.scalar_type())};
}

NormForward run_forward(const at::Tensor &x, const at::Tensor &residual, const at::Tensor &weight,
                        double eps) {
#ifdef RP_KERNELS_HAVE_CUDA
    if (x.is_cuda()) {
        c10::cuda::CUDAGuard guard(x.device());
        const int64_t dim = x.size(-1), rows = x.numel() / dim;
        NormForward f;
        f.y = at::empty_like(x);
        f.rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
        if (residual.defined())
            f.sum = at::empty_like(x);
        cudaError_t err = rms_norm_forward_cuda(
            elem_type(x.scalar_type()), x.data_ptr(),
            residual.defined() ? residual.data_ptr() : nullptr, weight.data_ptr(),
            residual.defined() ? f.sum.data_ptr() : nullptr, f.y.data_ptr(),
            f.rstd.data_ptr<float>(), rows, dim, static_cast<float>(eps), current_stream(x));
        if (err != cudaErrorNotSupported) {
            check_launch(err, "rms_norm forward");
            return f;
        }
    }
#endif
    return forward_aten(x, residual, weight, eps);
}

NormBackward run_backward(const at::Tensor &dy, const at::Tensor &dsum, const at::Tensor &x,
                          const at::Tensor &weight, const at::Tensor &rstd) {
#ifdef RP_KERNELS_HAVE_CUDA
    if (x.is_cuda()) {
        c10::cuda::CUDAGuard guard(x.device());
        const int64_t dim = x.size(-1), rows = x.numel() / dim;
        // Enough blocks to fill the GPU, each reducing many rows into its own fp32 partial of
        // dweight; fewer partials means less to sum afterwards.
        const int blocks =
            static_cast<int>(std::clamp<int64_t>(rows, 1, resident_blocks(x, /*per_sm=*/4)));
        at::Tensor dx = at::empty_like(x);
        at::Tensor partial = at::empty({blocks, dim}, x.options().dtype(at::kFloat));
        cudaError_t err = rms_norm_backward_cuda(
            elem_type(x.scalar_type()), dy.data_ptr(), dsum.defined() ? dsum.data_ptr() : nullptr,
            x.data_ptr(), weight.data_ptr(), rstd.data_ptr<float>(), dx.data_ptr(),
            partial.data_ptr<float>(), blocks, rows, dim, current_stream(x));
        if (err != cudaErrorNotSupported) {
            check_launch(err, "rms_norm backward");
            return {dx, partial.sum(0).to(weight.scalar_type())};
        }
    }
#endif
    return backward_aten(dy, dsum, x, weight, rstd);
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  public:
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                              double eps) {
        at::Tensor xc = x.contiguous(), wc = weight.contiguous();
        NormForward f = run_forward(xc, at::Tensor(), wc, eps);
        // The row's fp32 rstd is kept (4 bytes a row) so backward never recomputes the mean.
        ctx->save_for_backward({xc, wc, f.rstd});
        ctx->set_materialize_grads(false);
        return f.y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        if (!grads[0].defined())
            return {at::Tensor(), at::Tensor(), at::Tensor()};
        variable_list saved = ctx->get_saved_variables();
        NormBackward b = run_backward(grads[0].contiguous(), at::Tensor(), saved[0], saved[1],
                                      saved[2]);
        return {b.dx, b.dweight, at::Tensor()};
    }
};

class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
  public:
    static variable_list forward(AutogradContext *ctx, const at::Tensor &x,
                                 const at::Tensor &residual, const at::Tensor &weight,
                                 double eps) {
        at::Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
        NormForward f = run_forward(xc, rc, wc, eps);
        ctx->save_for_backward({f.sum, wc, f.rstd});
        ctx->set_materialize_grads(false);
        return {f.sum, f.y};
    }

    // grads: {d sum (from the residual stream's later uses), d normed}.
    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        const at::Tensor &dsum = grads[0], &dy = grads[1];
        if (!dy.defined())
            return {dsum, dsum, at::Tensor(), at::Tensor()};
        variable_list saved = ctx->get_saved_variables();
        NormBackward b = run_backward(dy.contiguous(),
                                      dsum.defined() ? dsum.contiguous() : at::Tensor(), saved[0],
                                      saved[1], saved[2]);
        // The sum's gradient reaches x and residual alike.
        return {b.dx, b.dx, b.dweight, at::Tensor()};
    }
};

} // namespace

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    check_norm_args("rms_norm", x, weight);
    return RmsNormFunction::apply(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x, const at::Tensor &residual,
                                               const at::Tensor &weight, double eps) {
    check_norm_args("add_rms_norm", x, weight);
    TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                    residual.device() == x.device(),
                "add_rms_norm: residual must match x (", x.sizes(), ", ",
                c10::toString(x.scalar_type()), ", ", x.device(), "), got ", residual.sizes(),
                ", ", c10::toString(residual.scalar_type()), ", ", residual.device());
    variable_list out = AddRmsNormFunction::apply(x, residual, weight, eps);
    return {out[0], out[1]};
}

} // namespace rp::kernels
