// What the engine lends caller-defined code (a layer's callbacks, a device loss) for one
// invocation: where it runs, which pass it is, and the layer's tensors on that device.
#pragma once
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "engine/layer.h"

namespace rp {

struct CallerCall {
    Phase phase = Phase::Forward;
    at::Device device = at::Device(at::kCPU);
    void *stream = nullptr; // the device's compute stream (cudaStream_t); null on CPU devices
    uint64_t seed = 0;      // the same in a forward and its recompute
    size_t microbatch = 0;
    bool training = false;
    std::vector<at::Tensor> params, buffers; // on the device, declaration order
};

} // namespace rp
