// The non-finite check's argument handling and its ATen twin (nonfinite.cu has the kernel).
#include "kernels/nonfinite.h"

#include <limits>

#include "kernels/dispatch.h"
#ifdef RP_KERNELS_HAVE_CUDA
#include "kernels/nonfinite_cuda.h"
#endif

namespace rp::kernels {
namespace {

// A read-only pass bound by memory bandwidth: this many blocks per SM keep it saturated.
constexpr int kBlocksPerSm = 4;

} // namespace

at::Tensor nonfinite_flag(const at::Tensor &t) {
    at::Tensor flag = at::zeros({}, t.options().dtype(at::kDouble));
#ifdef RP_KERNELS_HAVE_CUDA
    if (t.is_cuda() && supported_dtype(t.scalar_type())) {
        c10::cuda::CUDAGuard guard(t.device());
        const at::Tensor x = t.contiguous();
        check_launch(nonfinite_flag_cuda(elem_type(x.scalar_type()), x.data_ptr(), x.numel(),
                                         flag.data_ptr<double>(), resident_blocks(x, kBlocksPerSm),
                                         current_stream(x)),
                     "nonfinite flag");
        return flag;
    }
#endif
    // The twin: the same flag from ATen's isfinite (integer tensors are always finite).
    return flag.masked_fill_(at::isfinite(t).all().logical_not(),
                             std::numeric_limits<double>::infinity());
}

} // namespace rp::kernels
