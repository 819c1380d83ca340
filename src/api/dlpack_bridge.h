// DLPack in and out of the engine: borrowed, validated inputs become CPU tensors without a copy;
// engine tensors leave as caller-owned DLManagedTensor.
#pragma once
#include <string>

#include "api/roundpipe_internal.h"

namespace rp {

// Wraps a borrowed DLPack tensor (contiguous, a supported dtype; in host memory, or in the memory
// of one of `gpus` GPUs when the model runs on GPUs) without copying. `what` names it in error
// messages ("input 0", "labels"). `any_dtype`: every dtype libtorch knows (bool, uint8, float64,
// ...), for tensors the engine only slices and never computes with.
at::Tensor borrow_dlpack(const DLManagedTensor *tensor, const std::string &what, int gpus,
                         bool any_dtype = false);

// Takes ownership of a DLPack tensor produced by a callback (its deleter runs when the tensor
// dies). Validates it like borrow_dlpack for host memory; `allow_float64` also accepts float64 (gradients).
at::Tensor adopt_dlpack(DLManagedTensor *tensor, const std::string &what,
                        bool allow_float64 = false);

// Takes ownership of a tensor a caller-defined layer or device loss produced: any dtype libtorch
// knows, contiguous, in host memory or on one of `gpus` GPUs. The deleter runs on failure too.
at::Tensor adopt_dlpack_any(DLManagedTensor *tensor, const std::string &what, int gpus);

// A new caller-owned DLPack reference to `t`.
DLManagedTensor *export_dlpack(const at::Tensor &t);

} // namespace rp
