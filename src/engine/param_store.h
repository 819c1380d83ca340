// Host parameter store. Per parameter:
//   master    fp32 weights the optimizer updates;
//   live      model-dtype weights the devices compute with;
//   staged    model-dtype copy of the master written by the optimizer thread after each step,
//             swapped with `live` when the step is published (double buffer: an async step never
//             writes weights a running pipeline reads);
//   grad      fp32 gradient accumulated by forward_backward since the last step;
//   step_grad fp32 gradient the running step consumes (swapped with `grad` at rp_step).
#pragma once
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "layers/layer.h"

namespace rp {

enum class HostMemory {
    Pageable,   // ordinary allocations
    Pinned,     // page-locked allocations (fastest uploads)
    Registered  // ordinary allocations page-locked in place with cudaHostRegister
};

struct Param {
    std::string name;
    size_t layer;
    at::Tensor master, live, staged, grad, step_grad;
};

class ParamStore {
  public:
    // Initialises every parameter from `seed` (docs/semantics.md). `host_memory` says how the
    // model-dtype copies the devices read are page-locked (only meaningful with CUDA devices).
    ParamStore(const std::vector<std::unique_ptr<Layer>> &layers, at::ScalarType model_dtype,
               uint64_t seed, HostMemory host_memory);
    ~ParamStore();
    ParamStore(const ParamStore &) = delete;
    ParamStore &operator=(const ParamStore &) = delete;

    size_t size() const { return params_.size(); }
    Param &at(size_t i) { return params_[i]; }
    const Param &at(size_t i) const { return params_[i]; }
    const std::vector<size_t> &layer_params(size_t layer) const { return by_layer_[layer]; }
    at::ScalarType model_dtype() const { return model_dtype_; }
    int64_t find(const std::string &name) const; // -1 when absent

    void zero_grads();
    void swap_grads();            // grad <-> step_grad; step_grad must be zero
    void zero_step_grads();
    void stage_from_master();     // staged = master (optimizer thread)
    void publish_staged();        // live <-> staged
    void refresh_live_from_master(); // live = staged = master (nothing in flight)

  private:
    std::vector<Param> params_;
    std::vector<std::vector<size_t>> by_layer_;
    at::ScalarType model_dtype_;
    std::vector<void *> registered_; // host ranges to unregister at destruction
};

} // namespace rp
