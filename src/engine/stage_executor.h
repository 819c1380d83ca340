// What one stage job computes: a forward stage, the fused tail stage (forward, loss, backward
// without recompute) or a backward stage (recompute, then backward), over all microbatches.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "engine/call_state.h"
#include "engine/data_parallel.h"
#include "engine/device_lane.h"
#include "engine/grad_accumulator.h"
#include "engine/loss.h"
#include "engine/microbatch.h"
#include "engine/param_store.h"
#include "engine/run_config.h"
#include "engine/stage_planner.h"
#include "engine/step_gate.h"
#include "engine/layer.h"

namespace rp {

enum class JobKind { Forward, Tail, Backward };

// What a pipelined call runs: inference (forward stages); the fused training call (forward stages,
// the tail, backward stages); or upstream's non-fused training split in two calls, a forward that
// keeps every stage's input (training mode, no loss) and a later backward from the caller's
// gradients of the outputs (every stage recomputed, deepest first).
enum class CallKind { Inference, Fused, ForwardKeep, BackwardOnly };

// Everything one pipelined call shares between its jobs. Each job writes only its own slots.
//
// Forward jobs (and the fused tail) run `stages`; backward jobs run `backward_stages`, which are
// `stages` themselves unless the call has an asymmetric plan (upstream's execute plans: fewer,
// longer forward stages, shorter backward ones). Either way both lists run in ascending layer
// order, a fused call's last stage (the tail) is the last of both, and a training forward keeps
// the input of every backward stage: at the start of its own stage where they coincide, else
// downloaded from inside the forward stage that computes it.
struct CallContext {
    CallContext(const std::vector<std::unique_ptr<Layer>> &layers_,
                const std::vector<Stage> &stages_, const std::vector<Stage> &backward_stages_,
                const ParamStore &store_, const Microbatches &microbatches_);

    const std::vector<std::unique_ptr<Layer>> &layers;
    const std::vector<Stage> &stages;
    const std::vector<Stage> &backward_stages;
    // Per layer: the backward stage that starts there, or -1.
    std::vector<int> backward_stage_at;
    const ParamStore &store;
    const Microbatches &microbatches;
    uint64_t seed = 0;
    uint64_t call_index = 0;
    RecomputeGrain grain = RecomputeGrain::Stage;
    bool training = false; // training mode (dropout on); true for every kind but Inference
    CallKind kind = CallKind::Inference;
    const Loss *loss = nullptr;
    // BackwardOnly: per microbatch, the gradients of the last stage's outputs (undefined: none).
    std::vector<Transfer> output_grads;
    // BackwardOnly: also back-propagate into the first stage's floating inputs, into
    // `input_grads` ([mb][input of the first stage], host memory, model dtype).
    bool want_input_grads = false;
    at::Device output_device = at::Device(at::kCPU);
    bool keep_outputs = false;
    CallState *state = nullptr;
    // Per job: the index of the device it runs on (set by Pipeline::run).
    std::vector<size_t> job_device;
    bool next_job_on_same_device(size_t job) const {
        return job + 1 < job_device.size() && job_device[job + 1] == job_device[job];
    }
    // The call's GPUs copy from one another directly: a hand-off to another GPU leaves the
    // tensors where they are, for the next job's lane to copy (set by Pipeline::run).
    bool peer_hand_offs = false;
    // Memory-saving mode: a stage's weights go up only once `gate` holds step `gate_step` for
    // every parameter of the stage.
    const StepGate *gate = nullptr;
    int64_t gate_step = 0;
    // In-call steps: the rows of the model's lookup table this call reads (uint8 per row; see
    // Model::table_rows_of); undefined when its table's update is not deferred.
    at::Tensor table_rows;

    // Written by the jobs; read by the caller once every lane has finished.
    std::vector<std::vector<Transfer>> stage_inputs; // [backward stage][mb], in host memory
    std::vector<std::vector<at::Tensor>> outputs;    // [mb][output], on the output device
    std::vector<at::Tensor> losses;                  // [mb], 0-d
    std::vector<std::vector<at::Tensor>> input_grads; // [mb][input], want_input_grads only
    GradAccumulator *gradients = nullptr; // receives each training job's downloaded gradients
    // GPU data parallelism: final gradients are averaged over the ranks on the device before
    // they are downloaded (FinalGradients).
    DataParallel *device_reduction = nullptr;
    // Embeddings may give row (sparse) gradients; see LayerContext::row_gradients.
    bool row_gradients = false;
    // Standard mode, GPUs: the host tensors whose values `params` will have in the next call,
    // once they are final (the step running beside this call has written them), with the
    // ParamStore::weights_version that call must find; empty when not final yet. Pipeline::run
    // uploads them during each device's last job, for its first job of the next call
    // (carried_weights.h). Unset: no such upload.
    std::function<std::vector<at::Tensor>(const std::vector<size_t> &params, uint64_t *version)>
        next_call_weights;
    // The GPU memory cap (bytes; 0 unknown): whether a second job's weights fit beside them.
    int64_t gpu_memory_cap = 0;

    size_t num_microbatches() const { return microbatches.inputs.size(); }
};

// The layers job `kind` runs for stage index `stage`: ctx.backward_stages[stage] for backward
// jobs, ctx.stages[stage] for the others.
const Stage &job_stage(const CallContext &ctx, JobKind kind, size_t stage);

// The jobs of a call, in job order. Forward only: one per stage. Fused: S - 1 forward jobs, the
// tail (the last of both stage lists), B - 1 backward jobs. BackwardOnly: B backward jobs.
// Backward jobs go deepest stage first, on the stage inputs the forward kept.
struct CallJob {
    JobKind kind;
    size_t stage; // index into the list job_stage reads
};
std::vector<CallJob> call_jobs(const CallContext &ctx);

// The parameters `stage`'s layers read, in layer order (the order of its weight uploads).
std::vector<size_t> stage_params(const CallContext &ctx, const Stage &stage);

// Whether the weights of `stage` may be uploaded now without waiting for the optimizer.
bool stage_weights_ready(const CallContext &ctx, const Stage &stage);

// Starts uploading the weights of `stage` (on the lane's weight stream), first waiting for the
// optimizer where the call is gated.
Transfer upload_stage_weights(const CallContext &ctx, const Stage &stage, DeviceLane &lane,
                              size_t job);

// Identifies the call's job layout (kind, stages, devices): ranks that average gradients on the
// devices must agree on it.
uint64_t job_layout_fingerprint(const CallContext &ctx, size_t num_devices);

// Per parameter: how many of the call's jobs deliver a gradient of it (those that make autograd
// leaves of trainable parameters: the tail and backward jobs), for the gradient reduction.
std::vector<int> gradient_jobs_per_param(const CallContext &ctx);

// Runs job `job` of `kind` for stage index `stage` (see job_stage) with weights from
// upload_stage_weights.
void run_stage_job(CallContext &ctx, JobKind kind, size_t job, size_t stage, DeviceLane &lane,
                   const Transfer &weights);

// Runs every layer on an empty batch to reject inputs that do not fit before a call changes
// anything. Throws InvalidArgument naming the layer.
void check_shapes(const std::vector<std::unique_ptr<Layer>> &layers, const ParamStore &store,
                  const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                  const Loss *loss);

} // namespace rp
