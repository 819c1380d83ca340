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

struct SwigluForward {
    at::Tensor y;
    at::Tensor silu; // fp32 silu(gate), kept by the ATen twin only
};

// The ATen twin (CPU worker devices): the kernels' math in ATen operations. In fp32 the forward
// is Hugging Face's expression and the backward autograd's, operation for operation. Unlike the
// CUDA kernel it keeps silu(gate) for the backward, as autograd does: on a CPU a pass over the
// data costs more than the memory.
SwigluForward forward_aten(const at::Tensor &gate, const at::Tensor &up) {
    at::Tensor silu = at::silu(gate.to(at::kFloat));
    return {(silu * up.to(at::kFloat)).to(gate.scalar_type()), silu};
}

std::pair<at::Tensor, at::Tensor> backward_aten(const at::Tensor &dy, const at::Tensor &gate,
                                                const at::Tensor &up, const at::Tensor &silu) {
    // ATen's fused silu_backward, dy * s * (1 + g * (1 - s)), as autograd calls it.
    at::Tensor g = gate.to(at::kFloat), dyf = dy.to(at::kFloat);
    at::Tensor dgate = at::silu_backward(dyf * up.to(at::kFloat), g);
    at::Tensor dup = dyf * (silu.defined() ? silu : at::silu(g));
    return {dgate.to(gate.scalar_type()), dup.to(up.scalar_type())};
}

SwigluForward run_forward(const at::Tensor &gate, const at::Tensor &up) {
#ifdef RP_KERNELS_HAVE_CUDA
    if (gate.is_cuda()) {
        c10::cuda::CUDAGuard guard(gate.device());
        at::Tensor y = at::empty_like(gate);
        check_launch(swiglu_forward_cuda(elem_type(gate.scalar_type()), gate.data_ptr(),
                                         up.data_ptr(), y.data_ptr(), gate.numel(),
                                         resident_blocks(gate, kBlocksPerSm), current_stream(gate)),
                     "swiglu forward");
        return {y, at::Tensor()};
    }
#endif
    return forward_aten(gate, up);
}

std::pair<at::Tensor, at::Tensor> run_backward(const at::Tensor &dy, const at::Tensor &gate,
                                               const at::Tensor &up, const at::Tensor &silu) {
#ifdef RP_KERNELS_HAVE_CUDA
    if (gate.is_cuda()) {
        c10::cuda::CUDAGuard guard(gate.device());
        at::Tensor dgate = at::empty_like(gate), dup = at::empty_like(up);
        check_launch(
            swiglu_backward_cuda(elem_type(gate.scalar_type()), dy.data_ptr(), gate.data_ptr(),
                                 up.data_ptr(), dgate.data_ptr(), dup.data_ptr(), gate.numel(),
                                 resident_blocks(gate, kBlocksPerSm), current_stream(gate)),
            "swiglu backward");
        return {dgate, dup};
    }
#endif
    return backward_aten(dy, gate, up, silu);
}

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
  public:
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &gate, const at::Tensor &up) {
        at::Tensor g = gate.contiguous(), u = up.contiguous();
        SwigluForward f = run_forward(g, u);
        // The inputs, as autograd would keep them. The CUDA backward recomputes silu(gate)
        // rather than keep one more tensor of the MLP's widest shape: it is free in a pass
        // bound by memory.
        ctx->save_for_backward({g, u, f.silu});
        ctx->set_materialize_grads(false);
        return f.y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        if (!grads[0].defined())
            return {at::Tensor(), at::Tensor()};
        variable_list saved = ctx->get_saved_variables();
        auto [dgate, dup] = run_backward(grads[0].contiguous(), saved[0], saved[1], saved[2]);
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
                c10::toString(gate.scalar_type()), ", ", gate.device(), "), got ", up.sizes(), ", ",
                c10::toString(up.scalar_type()), ", ", up.device());
    return SwigluFunction::apply(gate, up);
}

} // namespace rp::kernels
