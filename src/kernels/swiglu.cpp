// SwiGLU's autograd function, argument checks, and the ATen twin of swiglu.cu's kernels.
#include "kernels/swiglu.h"

#include <utility>

#include <torch/csrc/autograd/custom_function.h>

#include "kernels/dispatch.h"
#ifdef RP_KERNELS_HAVE_CUDA
#include "kernels/swiglu_cuda.h"
#endif

namespace rp::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Grid-stride elementwise kernels: this many blocks per SM saturate memory bandwidth.
constexpr int kBlocksPerSm = 8;

// The ATen twin (CPU worker devices): the kernels' math in ATen operations. In fp32 the forward
// is Hugging Face's expression and the backward autograd's, operation for operation.
at::Tensor forward_aten(const at::Tensor &gate, const at::Tensor &up) {
    return (at::silu(gate.to(at::kFloat)) * up.to(at::kFloat)).to(gate.scalar_type());
}

std::pair<at::Tensor, at::Tensor> backward_aten(const at::Tensor &dy, const at::Tensor &gate,
                                                const at::Tensor &up) {
    at::Tensor g = gate.to(at::kFloat), dyf = dy.to(at::kFloat);
    at::Tensor s = at::sigmoid(g);
    at::Tensor dgate = (dyf * up.to(at::kFloat)) * (s * (1.0 + g * (1.0 - s)));
    at::Tensor dup = dyf * at::silu(g);
    return {dgate.to(gate.scalar_type()), dup.to(up.scalar_type())};
}

at::Tensor run_forward(const at::Tensor &gate, const at::Tensor &up) {
#ifdef RP_KERNELS_HAVE_CUDA
    if (gate.is_cuda()) {
        c10::cuda::CUDAGuard guard(gate.device());
        at::Tensor y = at::empty_like(gate);
        check_launch(swiglu_forward_cuda(elem_type(gate.scalar_type()), gate.data_ptr(),
                                         up.data_ptr(), y.data_ptr(), gate.numel(),
                                         resident_blocks(gate, kBlocksPerSm),
                                         current_stream(gate)),
                     "swiglu forward");
        return y;
    }
#endif
    return forward_aten(gate, up);
}

std::pair<at::Tensor, at::Tensor> run_backward(const at::Tensor &dy, const at::Tensor &gate,
                                               const at::Tensor &up) {
#ifdef RP_KERNELS_HAVE_CUDA
    if (gate.is_cuda()) {
        c10::cuda::CUDAGuard guard(gate.device());
        at::Tensor dgate = at::empty_like(gate), dup = at::empty_like(up);
        check_launch(swiglu_backward_cuda(elem_type(gate.scalar_type()), dy.data_ptr(),
                                          gate.data_ptr(), up.data_ptr(), dgate.data_ptr(),
                                          dup.data_ptr(), gate.numel(),
                                          resident_blocks(gate, kBlocksPerSm),
                                          current_stream(gate)),
                     "swiglu backward");
        return {dgate, dup};
    }
#endif
    return backward_aten(dy, gate, up);
}

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
  public:
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &gate, const at::Tensor &up) {
        at::Tensor g = gate.contiguous(), u = up.contiguous();
        // The inputs, as autograd would keep them: silu(gate) is recomputed in backward rather
        // than stored (one more tensor of the MLP's widest shape).
        ctx->save_for_backward({g, u});
        ctx->set_materialize_grads(false);
        return run_forward(g, u);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        if (!grads[0].defined())
            return {at::Tensor(), at::Tensor()};
        variable_list saved = ctx->get_saved_variables();
        auto [dgate, dup] = run_backward(grads[0].contiguous(), saved[0], saved[1]);
        return {dgate, dup};
    }
};

} // namespace

at::Tensor swiglu(const at::Tensor &gate, const at::Tensor &up) {
    TORCH_CHECK(supported_dtype(gate.scalar_type()), "swiglu: no kernel for dtype ",
                c10::toString(gate.scalar_type()), " (float32, bfloat16 and float16 have one)");
    TORCH_CHECK(up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type() &&
                    up.device() == gate.device(),
                "swiglu: up must match gate (", gate.sizes(), ", ",
                c10::toString(gate.scalar_type()), ", ", gate.device(), "), got ", up.sizes(),
                ", ", c10::toString(up.scalar_type()), ", ", up.device());
    return SwigluFunction::apply(gate, up);
}

} // namespace rp::kernels
