// The ATen side of a kernel call, shared by every kernel's .cpp: which element type a tensor
// has, where its CUDA work goes, and how a failed launch becomes a c10::Error.
#pragma once
#include <ATen/ATen.h>

#include "kernels/elem_type.h"

#ifdef RP_KERNELS_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

namespace rp::kernels {

// The dtypes our kernels have code for (the models run in bf16 on GPUs and fp32 on CPUs).
inline bool supported_dtype(at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

inline ElemType elem_type(at::ScalarType t) {
    switch (t) {
    case at::kFloat:
        return ElemType::F32;
    case at::kBFloat16:
        return ElemType::BF16;
    case at::kHalf:
        return ElemType::F16;
    default:
        TORCH_CHECK(false, "rp kernels: no kernel for dtype ", c10::toString(t));
    }
}

#ifdef RP_KERNELS_HAVE_CUDA
// The engine makes its compute stream current on each device before it runs a layer, so the
// kernels queue behind the matmuls that produced their inputs without any extra sync.
inline cudaStream_t current_stream(const at::Tensor &t) {
    return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Blocks that keep every SM busy (grid-stride kernels that reduce per-block partials).
inline int resident_blocks(const at::Tensor &t, int per_sm) {
    return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount * per_sm;
}

// A launch error (bad configuration, no kernel image for this GPU) is reported where it
// happened, with the kernel's name, rather than at the next synchronising call.
inline void check_launch(cudaError_t err, const char *kernel) {
    TORCH_CHECK(err == cudaSuccess, kernel, ": CUDA kernel launch failed: ",
                cudaGetErrorString(err));
}
#endif

} // namespace rp::kernels
