// What one stage job computes: a forward stage, the fused tail stage (forward, loss, backward
// without recompute) or a backward stage (recompute, then backward), over all microbatches.
#pragma once
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "engine/call_state.h"
#include "engine/loss.h"
#include "engine/microbatch.h"
#include "engine/param_store.h"
#include "engine/run_config.h"
#include "engine/stage_planner.h"
#include "layers/layer.h"

namespace rp {

// Everything one pipelined call shares between its jobs. Each job writes only its own slots.
struct CallContext {
    CallContext(const std::vector<std::unique_ptr<Layer>> &layers_, const std::vector<Stage> &stages_,
                const ParamStore &store_, const Microbatches &microbatches_)
        : layers(layers_), stages(stages_), store(store_), microbatches(microbatches_) {}

    const std::vector<std::unique_ptr<Layer>> &layers;
    const std::vector<Stage> &stages;
    const ParamStore &store;
    const Microbatches &microbatches;
    uint64_t seed = 0;
    uint64_t call_index = 0;
    RecomputeGrain grain = RecomputeGrain::Stage;
    bool training = false;
    const Loss *loss = nullptr;
    at::Device output_device = at::Device(at::kCPU);
    bool keep_outputs = false;
    CallState *state = nullptr;

    std::vector<std::vector<at::Tensor>> stage_inputs;         // [stage][mb], kept for recompute
    std::vector<at::Tensor> outputs;                          // [mb]
    std::vector<double> losses;                               // [mb]
    std::vector<std::vector<std::pair<size_t, at::Tensor>>> job_grads; // [job]: (param, grad)

    size_t num_microbatches() const { return microbatches.inputs.size(); }
};

void run_forward_job(CallContext &ctx, size_t job, size_t stage, at::Device device);
void run_tail_job(CallContext &ctx, size_t job, size_t stage, at::Device device);
void run_backward_job(CallContext &ctx, size_t job, size_t stage, at::Device device);

// Runs every layer on an empty batch to reject inputs that do not fit before a call
// changes anything. Throws InvalidArgument naming the layer.
void check_shapes(const std::vector<std::unique_ptr<Layer>> &layers, const ParamStore &store,
                  const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                  const Loss *loss);

} // namespace rp
