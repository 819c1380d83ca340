// The element types our kernels are built for, named without ATen so that the CUDA launchers
// (compiled by nvcc, which never sees libtorch's headers) and their ATen-facing callers agree.
#pragma once

namespace rp::kernels {

enum class ElemType : int { F32 = 0, BF16 = 1, F16 = 2 };

} // namespace rp::kernels
