// Whether a tensor holds inf or nan, in one read of its bytes: the engine's check of every
// gradient as it leaves a device (engine/final_gradients.cpp), so the host knows a step's
// gradients are not finite without reading them again, and the loss scaler's check of the
// host's gradients (engine/grad_scaler.cpp).
#pragma once
#include <ATen/ATen.h>

namespace rp::kernels {

// A 0-d float64 tensor on t's device: 0 when every element of t is finite, +inf when any is
// inf or nan. Flags add up as the checks did when they were sums (any non-finite flag makes the
// total infinite; a sum of zeros and infinities cannot turn finite), and unlike a sum a flag
// cannot overflow. float32, bfloat16 and float16 on a GPU, and every floating dtype on the CPU,
// are read once (a kernel, a parallel loop); anything else takes ATen's isfinite. An empty
// tensor is finite.
at::Tensor nonfinite_flag(const at::Tensor &t);

} // namespace rp::kernels
