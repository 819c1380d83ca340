// The non-finite check's argument handling and its CPU twin (nonfinite.cu has the GPU kernel).
#include "kernels/nonfinite.h"

#include <cmath>
#include <functional>
#include <limits>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "kernels/dispatch.h"
#ifdef RP_KERNELS_HAVE_CUDA
#include "kernels/nonfinite_cuda.h"
#endif

namespace rp::kernels {
namespace {

// A read-only pass bound by memory bandwidth: this many blocks per SM keep it saturated.
constexpr int kBlocksPerSm = 4;

// Elements per task of the CPU loop: large enough that a task outweighs its scheduling.
constexpr int64_t kCpuGrain = int64_t{1} << 16;

// The CPU twin: one parallel read of a contiguous floating-point tensor, no mask and no
// widened copy (ATen's float64 sum of a float tensor first makes a float64 copy of it). Every
// floating type widens to double exactly, so the test is the element's own finiteness.
bool any_nonfinite_cpu(const at::Tensor &x) {
    bool any = false;
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, x.scalar_type(), "nonfinite_flag", [&] {
            const scalar_t *data = x.const_data_ptr<scalar_t>();
            any = at::parallel_reduce(
                0, x.numel(), kCpuGrain, false,
                [&](int64_t begin, int64_t end, bool found) {
                    for (int64_t i = begin; i < end; ++i)
                        found |= !std::isfinite(static_cast<double>(data[i]));
                    return found;
                },
                std::logical_or<bool>());
        });
    return any;
}

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
    constexpr double inf = std::numeric_limits<double>::infinity();
    if (t.is_cpu() && at::isFloatingType(t.scalar_type()) && !t.is_sparse()) {
        if (any_nonfinite_cpu(t.contiguous()))
            flag.fill_(inf);
        return flag;
    }
    // Anything else (float64 on a GPU, integers, which are always finite): ATen's isfinite.
    return flag.masked_fill_(at::isfinite(t).all().logical_not(), inf);
}

} // namespace rp::kernels
