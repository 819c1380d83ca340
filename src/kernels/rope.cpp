// The rotary embedding's autograd function, argument checks, and the ATen twin of rope.cu's
// kernels.
#include "kernels/rope.h"

#include <algorithm>
#include <optional>

#include <torch/csrc/autograd/custom_function.h>

#include "kernels/dispatch.h"
#ifdef RP_KERNELS_HAVE_CUDA
#include "kernels/rope_cuda.h"
#endif

namespace rp::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RopeForward {
    at::Tensor y;
    at::Tensor rstd; // fp32 [batch, seq, heads], with the norm only
};

struct RopeBackward {
    at::Tensor dx;
    at::Tensor dweight;
};

// cos/sin [cb, t, half] -> [cb, t, 1, half] in fp32, to broadcast over the heads.
at::Tensor table(const at::Tensor &t) { return t.unsqueeze(2).to(at::kFloat); }

// The ATen twin (CPU worker devices): the kernels' math in ATen operations. In fp32 it is
// Hugging Face's expression: z1*c - z2*s equals z1*c + (-z2)*s bit for bit.
RopeForward forward_aten(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin,
                         const at::Tensor &weight, double eps) {
    RopeForward f;
    const int64_t half = x.size(-1) / 2;
    at::Tensor z = x;
    if (weight.defined()) {
        at::Tensor xf = x.to(at::kFloat);
        f.rstd = at::rsqrt(xf.pow(2).mean({-1}) + eps);
        z = weight * (xf * f.rstd.unsqueeze(-1)).to(x.scalar_type());
    }
    at::Tensor c = table(cos), s = table(sin);
    at::Tensor z1 = z.narrow(-1, 0, half).to(at::kFloat), z2 = z.narrow(-1, half, half).to(at::kFloat);
    f.y = at::cat({z1 * c - z2 * s, z2 * c + z1 * s}, -1).to(x.scalar_type());
    return f;
}

RopeBackward backward_aten(const at::Tensor &dy, const at::Tensor &x, const at::Tensor &cos,
                           const at::Tensor &sin, const at::Tensor &weight,
                           const at::Tensor &rstd) {
    const int64_t dim = x.size(-1), half = dim / 2;
    at::Tensor c = table(cos), s = table(sin);
    at::Tensor g1 = dy.narrow(-1, 0, half).to(at::kFloat),
               g2 = dy.narrow(-1, half, half).to(at::kFloat);
    at::Tensor dz = at::cat({g1 * c + g2 * s, g2 * c - g1 * s}, -1); // the inverse rotation
    if (!weight.defined())
        return {dz.to(x.scalar_type()), at::Tensor()};
    at::Tensor r = rstd.unsqueeze(-1);
    at::Tensor n = x.to(at::kFloat) * r;
    at::Tensor dn = dz * weight.to(at::kFloat);
    at::Tensor dx = r * (dn - n * (dn * n).mean({-1}, true));
    at::Tensor dw = (dz * n.to(x.scalar_type()).to(at::kFloat)).reshape({-1, dim}).sum(0);
    return {dx.to(x.scalar_type()), dw.to(weight.scalar_type())};
}

RopeForward run_forward(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin,
                        const at::Tensor &weight, double eps) {
#ifdef RP_KERNELS_HAVE_CUDA
    if (x.is_cuda()) {
        c10::cuda::CUDAGuard guard(x.device());
        RopeForward f;
        f.y = at::empty_like(x);
        if (weight.defined())
            f.rstd = at::empty(x.sizes().slice(0, 3), x.options().dtype(at::kFloat));
        cudaError_t err = rope_forward_cuda(
            elem_type(x.scalar_type()), x.data_ptr(),
            weight.defined() ? weight.data_ptr() : nullptr, cos.data_ptr(), sin.data_ptr(),
            f.y.data_ptr(), weight.defined() ? f.rstd.data_ptr<float>() : nullptr,
            x.numel() / x.size(3), x.size(2), x.size(1), cos.size(0), x.size(3),
            static_cast<float>(eps), current_stream(x));
        if (err != cudaErrorNotSupported) {
            check_launch(err, "rope forward");
            return f;
        }
    }
#endif
    return forward_aten(x, cos, sin, weight, eps);
}

RopeBackward run_backward(const at::Tensor &dy, const at::Tensor &x, const at::Tensor &cos,
                          const at::Tensor &sin, const at::Tensor &weight,
                          const at::Tensor &rstd) {
#ifdef RP_KERNELS_HAVE_CUDA
    if (x.is_cuda()) {
        c10::cuda::CUDAGuard guard(x.device());
        const int64_t dim = x.size(3), rows = x.numel() / dim;
        // Fill the GPU; each block reduces its rows' dweight into one fp32 partial.
        const int blocks = static_cast<int>(
            std::clamp<int64_t>((rows + 31) / 32, 1, resident_blocks(x, /*per_sm=*/4)));
        at::Tensor dx = at::empty_like(x);
        at::Tensor partial;
        if (weight.defined())
            partial = at::empty({blocks, dim}, x.options().dtype(at::kFloat));
        cudaError_t err = rope_backward_cuda(
            elem_type(x.scalar_type()), dy.data_ptr(), x.data_ptr(),
            weight.defined() ? weight.data_ptr() : nullptr,
            weight.defined() ? rstd.data_ptr<float>() : nullptr, cos.data_ptr(), sin.data_ptr(),
            dx.data_ptr(), weight.defined() ? partial.data_ptr<float>() : nullptr, blocks, rows,
            x.size(2), x.size(1), cos.size(0), dim, current_stream(x));
        if (err != cudaErrorNotSupported) {
            check_launch(err, "rope backward");
            if (!weight.defined())
                return {dx, at::Tensor()};
            return {dx, partial.sum(0).to(weight.scalar_type())};
        }
    }
#endif
    return backward_aten(dy, x, cos, sin, weight, rstd);
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
  public:
    // The weight is optional rather than an undefined tensor: autograd records every tensor
    // argument's metadata, which an undefined tensor does not have.
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &cos,
                              const at::Tensor &sin, const std::optional<at::Tensor> &weight,
                              double eps) {
        at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
        at::Tensor wc = weight.has_value() ? weight->contiguous() : at::Tensor();
        RopeForward f = run_forward(xc, cc, sc, wc, eps);
        // Without the norm the backward needs only the tables (x's shape comes with dy).
        ctx->save_for_backward({wc.defined() ? xc : at::Tensor(), cc, sc, wc, f.rstd});
        ctx->set_materialize_grads(false);
        return f.y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        if (!grads[0].defined())
            return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
        variable_list saved = ctx->get_saved_variables();
        at::Tensor dy = grads[0].contiguous();
        // x stands in for itself only through its shape when there is no norm.
        const at::Tensor &x = saved[0].defined() ? saved[0] : dy;
        RopeBackward b = run_backward(dy, x, saved[1], saved[2], saved[3], saved[4]);
        return {b.dx, at::Tensor(), at::Tensor(), b.dweight, at::Tensor()};
    }
};

} // namespace

at::Tensor rope(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin,
                const at::Tensor &norm_weight, double eps) {
    TORCH_CHECK(x.dim() == 4 && x.size(3) > 0 && x.size(3) % 2 == 0, "rope: x must be [batch, "
                "seq, heads, head_dim] with an even head_dim, got ", x.sizes());
    TORCH_CHECK(supported_dtype(x.scalar_type()), "rope: no kernel for dtype ",
                c10::toString(x.scalar_type()), " (float32, bfloat16 and float16 have one)");
    const int64_t b = x.size(0), t = x.size(1), half = x.size(3) / 2;
    for (const at::Tensor *table : {&cos, &sin}) {
        TORCH_CHECK(table->dim() == 3 && (table->size(0) == 1 || table->size(0) == b) &&
                        table->size(1) == t && table->size(2) == half,
                    "rope: cos and sin must be [1 or ", b, ", ", t, ", ", half, "], got ",
                    table->sizes());
        TORCH_CHECK(table->scalar_type() == x.scalar_type() && table->device() == x.device(),
                    "rope: cos and sin must be ", c10::toString(x.scalar_type()), " on ",
                    x.device(), ", got ", c10::toString(table->scalar_type()), " on ",
                    table->device());
    }
    if (norm_weight.defined())
        TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == x.size(3) &&
                        norm_weight.scalar_type() == x.scalar_type() &&
                        norm_weight.device() == x.device(),
                    "rope: norm_weight must be [", x.size(3), "], ",
                    c10::toString(x.scalar_type()), " on ", x.device(), ", got ",
                    norm_weight.sizes(), ", ", c10::toString(norm_weight.scalar_type()), " on ",
                    norm_weight.device());
    std::optional<at::Tensor> weight;
    if (norm_weight.defined())
        weight = norm_weight;
    return RopeFunction::apply(x, cos, sin, weight, eps);
}

} // namespace rp::kernels
