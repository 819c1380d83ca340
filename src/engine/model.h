// A RoundPipe model: layers, host parameter store, stage plan, device workers and the optimizer
// thread, and the training-loop semantics that tie them (docs/semantics.md).
#pragma once
#include <atomic>
#include <functional>
#include <map>
#include <tuple>
#include <memory>
#include <optional>
#include <unordered_set>
#include <string>
#include <vector>

#include "engine/call_rows.h"
#include "engine/data_parallel.h"
#include "engine/final_feed.h"
#include "engine/grad_accumulator.h"
#include "engine/grad_flags.h"
#include "engine/grad_scaler.h"
#include "engine/host_timeline.h"
#include "engine/layer.h"
#include "engine/loss.h"
#include "engine/param_store.h"
#include "engine/pipeline.h"
#include "engine/run_config.h"
#include "engine/stage_planner.h"
#include "engine/stage_times.h"
#include "engine/step_gate.h"
#include "engine/trace.h"
#include "optim/builtin_optimizer.h"
#include "optim/step_runner.h"

namespace rp {

enum class DeviceKind { Auto, Cpu, Cuda };
enum class PinMode { Alloc, Register, Off };

struct ModelOptions {
    at::ScalarType model_dtype = at::kFloat;
    PinMode pin_mode = PinMode::Alloc;
    RunConfig run_config;
    uint64_t seed = 0;
    std::string name = "roundpipe";
    DeviceKind device_kind = DeviceKind::Auto;
    int num_devices = 0; // 0: all GPUs, or one CPU device
    std::vector<int> stage_plan; // empty: automatic
    // GPU memory a model may use per GPU; 0: 80% of the smallest free memory at creation. On CPU
    // devices nothing is capped, but an explicit cap still shapes the plan (plans can be
    // previewed and tested without a GPU).
    int64_t gpu_memory_cap = 0;
    // Dynamic loss scaling: initial scale (0: off; negative: the default, 65536 for fp16 models
    // and off otherwise) and the number of good steps between doublings.
    double grad_scale = -1.0;
    int grad_scale_growth_interval = 2000;
    HostMemoryMode host_memory_mode = HostMemoryMode::Standard;
    // Skip a step whose gradients hold inf or nan (with loss scaling on, its rule decides).
    bool skip_nonfinite_steps = true;
    DataParallelOptions data_parallel; // world_size 0: one process
};

// An optimizer update over master weights from step gradients. It may call `param_done` as
// soon as parameter i is final, which lets the next call upload that parameter early in
// memory-saving mode.
// `published`: the update already refreshed the parameter's weight copy and zeroed its gradient.
// `has_grad[i]`: parameter i received a gradient since the previous step.
using ParamDone = BuiltinOptimizer::ParamDone;
using StepUpdate =
    std::function<void(const ParamDone &param_done, const std::vector<uint8_t> &has_grad)>;

int visible_cuda_devices();

class Model {
  public:
    Model(std::vector<std::unique_ptr<Layer>> layers, const ModelOptions &options);
    ~Model(); // drains the optimizer thread before the workers go

    // Inference over microbatches. Returns the outputs as the resolved configuration says: one
    // merged tensor, or one per microbatch; never a view of the caller's inputs.
    std::vector<at::Tensor> forward(const std::vector<at::Tensor> &inputs, const RunConfig &call);
    // Fused forward + backward; returns the summed loss. For LossKind::CausalLm `loss.scale` is
    // divided by the call's number of targets, so the result is the batch mean. `outputs` (may be
    // null) receives the outputs as forward() returns them.
    double forward_backward(const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                            const Loss &loss, const RunConfig &call,
                            std::vector<at::Tensor> *outputs);

    // Upstream's non-fused training: a forward in training mode that keeps what a later
    // backward() needs (every stage's input); outputs as forward() returns them.
    std::vector<at::Tensor> forward_train(const std::vector<at::Tensor> &inputs,
                                          const RunConfig &call);
    // Back-propagates the caller's gradients of the last forward_train's outputs (as it returned
    // them; undefined: none) and accumulates the parameter gradients. Once per forward_train;
    // refused after an optimizer step or a load since that forward.
    // `input_grads` (may be null) receives the gradients of the forward's inputs, one per
    // input in its shape and dtype; undefined for inputs that are not floating point or that no
    // layer reads. Refused (before anything is consumed) when the forward split its inputs with
    // a split callback, whose pieces cannot be put back together.
    void backward(const std::vector<at::Tensor> &output_grads,
                  std::vector<at::Tensor> *input_grads = nullptr);
    bool backward_pending() const { return pending_ != nullptr; }

    // Queues `update` (which changes master weights from step grads) as the next step.
    void step(StepUpdate update, bool async);
    void step_builtin(const OptimizerSettings &settings, bool async);
    // In-call steps (memory-saving mode, rp_model_set_step_in_call): each fused training call is
    // also the built-in optimizer's step over its gradients, each parameter updated on the
    // optimizer thread as soon as its gradient is final. Null switches back to explicit steps.
    // Refused, with nothing changed, where the mode cannot hold (check_step_in_call).
    void set_step_in_call(const OptimizerSettings *settings);
    bool step_in_call() const { return in_call_.has_value(); }
    void synchronize();
    void zero_grad();
    // Replaces every master weight (all validated by the caller) and drops accumulated grads.
    void load_master(const std::vector<at::Tensor> &values);

    ParamStore &params() { return store_; }
    const ParamStore &params() const { return store_; }
    size_t num_layers() const { return layers_.size(); }
    size_t num_stages() const { return stages_.size(); }
    // Layers per stage of the plan of the last call (before any call: the plan for weights
    // alone).
    std::vector<int> stage_plan() const;
    // A plan the automatic planner makes for the layers' costs with each stage's fixed bytes
    // (weights and gradients in the model dtype, plus workspaces) at most `max_stage_bytes`
    // (<= 0: no limit) and at least `min_stages` stages (at most one per layer); the model's
    // own plan is left alone (upstream's ModelExecutePlan.auto with model_memory_limit).
    // Throws InvalidArgument when one layer alone is over the limit.
    std::vector<int> plan_stages(double max_stage_bytes, size_t min_stages) const;
    // Tokens of the largest microbatch: what Layer::activation_bytes_per_token is per. Input 0
    // decides: each element of an integer tensor (token ids) is a token; a floating tensor has
    // one per row along its last dimension.
    static int64_t tokens_per_microbatch(const Microbatches &mb);
    // A new explicit plan (empty: the automatic planner). Validated first; refused while a
    // training forward awaits its backward (its kept stage inputs follow the old stages). The
    // backward stages go back to being the forward ones.
    void set_stage_plan(const std::vector<int> &layers_per_stage);
    // Backward stages that differ from the forward ones (upstream's asymmetric execute plans),
    // in ascending layer order; empty: the forward stages. Needs an explicit forward plan (an
    // automatic one changes with the call shape); refused while a training forward awaits its
    // backward. A fused call further needs both plans to end with the same stage (the tail).
    void set_backward_stage_plan(const std::vector<int> &layers_per_stage);
    // Layers per backward stage of the plan in force.
    std::vector<int> backward_stage_plan() const;
    // The model's run configuration overlaid by `call`, defaults filled in, output device checked.
    ResolvedRunConfig resolve_run_config(const RunConfig &call) const;
    size_t num_devices() const { return pipeline_.num_devices(); }
    bool has_cuda_devices() const { return !pipeline_.device(0).is_cpu(); }
    int64_t steps_enqueued() const { return enqueued_; }
    bool on_optimizer_thread() const { return runner_.on_this_thread(); }
    int64_t gpu_memory_cap() const { return gpu_memory_cap_; }
    double grad_scale() const { return scaler_.enabled() ? scaler_.scale() : 0.0; }
    // Steps skipped for gradients holding inf or nan, by the loss scaler or the non-finite rule.
    int64_t skipped_steps() const { return scaler_.skipped_steps() + nonfinite_skips_.load(); }
    // Runtime switches of the loss scaler (initial_scale 0: off) and of the non-finite rule.
    // Driving thread: the queued steps finish first (they decide with the old setting).
    void set_grad_scaler(double initial_scale, int growth_interval);
    void set_skip_nonfinite_steps(bool skip);
    // Training calls whose loss was inf or nan.
    int64_t nonfinite_losses() const { return nonfinite_losses_; }
    // Parameter i's gradient for the API, in fp32 (a lent one is widened first): inside a step
    // callback (on the optimizer thread) the gradient of that step; elsewhere the one
    // accumulated since, a writable view, counted as a gradient.
    at::Tensor exposed_grad(size_t i);
    // Whether parameter i's gradient received anything (a call reached it, or a view of it was
    // handed out): inside a step callback, the gradient of that step; elsewhere, since the last
    // step. A parameter without one is what torch.optim sees as .grad None.
    bool grad_received(size_t i) const;
    // Host bytes of parameter state, built-in optimizer state included; `elements` receives the
    // parameter count.
    int64_t host_state_bytes(int64_t *elements) const;
    // The timing record of the last call: device stream spans and host thread spans.
    std::vector<TraceEvent> trace() const;
    const std::string &name() const { return name_; }
    // Data parallel: this process's rank and the number of ranks (0 and 1 otherwise).
    int rank() const { return dp_ ? dp_->rank() : 0; }
    int world_size() const { return dp_ ? dp_->world_size() : 1; }
    // Checkpoints are written once, by rank 0; the other ranks' saves do nothing.
    bool writes_checkpoints() const { return rank() == 0; }

  private:
    // What a forward_train leaves for its backward.
    struct PendingBackward {
        Microbatches microbatches; // owned copies of the call's inputs
        std::vector<std::vector<Transfer>> stage_inputs; // [backward stage][mb], host
        std::vector<std::vector<std::vector<int64_t>>> output_shapes; // [mb][output]
        uint64_t call_index = 0; // dropout masks of the recompute match the forward's
        RecomputeGrain grain = RecomputeGrain::Stage;
        std::vector<Stage> stages;          // the forward's plan
        std::vector<Stage> backward_stages; // its stage inputs are kept per backward stage
        bool merged = true;
        int64_t step = 0; // steps enqueued at the forward
        // To put input gradients back together: each input's split dim (kReplicate: every
        // microbatch got all of it), its dtype, and whether a split callback cut the inputs.
        std::vector<int> input_split_dims;
        std::vector<at::ScalarType> input_dtypes;
        bool custom_split = false;
    };
    std::vector<at::Tensor> merge_input_grads(const PendingBackward &p,
                                              std::vector<std::vector<at::Tensor>> per_mb,
                                              double unscale) const;
    std::vector<Transfer> split_output_grads(const PendingBackward &p,
                                             const std::vector<at::Tensor> &grads) const;

    void check_output_device(const at::Device &d) const;
    // The start every forward-only call (rp_forward, rp_forward_train) shares: the timing record
    // restarted, the inputs checked and split into microbatches by `cfg`.
    Microbatches begin_forward_call(const std::vector<at::Tensor> &inputs,
                                    const ResolvedRunConfig &cfg);
    void check_index_ranges(const std::vector<at::Tensor> &inputs, const at::Tensor &labels) const;
    std::vector<at::Tensor> finish_outputs(std::vector<std::vector<at::Tensor>> per_mb,
                                           bool merge,
                                           const std::vector<at::Tensor> &inputs) const;
    void publish_completed_step();
    // The gradients the step reads, each in its buffer (lent ones widened into it first).
    std::vector<at::Tensor> step_grads();
    // For the built-in AdamW: a lent gradient where it landed (bf16), else the buffer.
    std::vector<at::Tensor> step_grads_as_lent() const;
    // For the built-in AdamW: the rows added in fp32 to each lent gradient (none: undefined).
    std::vector<AddedRows> step_grads_added_rows() const;
    // The built-in optimizer of `kind` (created at first use; refused if the model holds state
    // of another kind).
    BuiltinOptimizer &builtin_optimizer(OptimizerKind kind);
    // Master weights to update and, in saving mode, the bf16 weight copies the update refreshes
    // in the same pass (undefined where there is none: frozen parameters, fp32 models).
    void builtin_targets(std::vector<at::Tensor> &params, std::vector<at::Tensor> &lives) const;
    // Throws State unless an in-call step can run now: saving mode, no loss scaling, no
    // gradients waiting for a step.
    void check_step_in_call() const;
    // Throws State while in-call steps are on (explicit steps would race them).
    void check_explicit_step() const;
    // In-call steps: queues this call's step on the optimizer thread and has the gradient
    // thread feed it each final gradient; the caller closes the returned feed when the call ends.
    std::shared_ptr<FinalFeed> start_in_call_step(const CallContext &ctx);
    void run_in_call_step(const OptimizerSettings &settings, FinalFeed &feed, int64_t number);
    // Deferred table rows (model_table_rows.cpp, docs/semantics.md): the store index of the
    // first layer's lookup table whose update an in-call step may split (-1: none), found once.
    int64_t find_lookup_table() const;
    // The rows of that table the call of `mb` reads (uint8 per row), when this call's in-call
    // step will split the table's update; undefined otherwise.
    at::Tensor table_rows_of(const Microbatches &mb) const;
    // Optimizer thread, in-call step `number` with a split table update pending: once the next
    // call has posted the rows it reads, updates those and opens the table to that call.
    // `served`: done already (once a step).
    void serve_next_call_rows(int64_t number, bool &served);
    void run_step(const StepUpdate &update, const GradFlags::Snapshot &grads, int64_t number);
    // Memory-saving mode, optimizer thread: step `number` is done with parameter i (`published`:
    // the update refreshed its weight copy and zeroed its gradient); it opens to the next call.
    void param_finished(size_t i, bool published, std::vector<bool> &finished, int64_t number);
    // Optimizer thread, at the end of step `number`, whatever happened: every parameter it did
    // not finish gets its weight copy refreshed and its gradient zeroed, and every parameter
    // opens (gate_): to the next call in saving mode, to the next call's early upload in the
    // standard mode. Explicit and in-call steps alike.
    void finish_unfinished(const std::vector<bool> &finished, int64_t number);
    bool step_may_proceed(const GradFlags::Snapshot &grads, int64_t number);
    void gate_call(CallContext &ctx) const;
    // Standard mode on GPUs: lets the call upload, during each device's last job, the weights
    // the next call's first job there will read (CallContext::next_call_weights).
    void offer_next_call_weights(CallContext &ctx) const;
    void check_shapes_once(const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                           const Loss *loss);
    double layer_param_bytes(size_t layer) const;
    void grant_workspaces();
    // The plan for a call of `tokens` per microbatch (cached by call shape); becomes stages_.
    const std::vector<Stage> &plan_call(int64_t tokens, RecomputeGrain grain, StageUse use);
    std::vector<Stage> make_plan(int64_t tokens, RecomputeGrain grain, StageUse use) const;
    // The backward stages of a call whose forward runs `forward`.
    std::vector<Stage> backward_plan_for(const std::vector<Stage> &forward) const;
    // After a GPU training call under the automatic plan: keeps each stage's fastest time since
    // the plan was set and re-plans from them at the kReplanAfterCalls-th call.
    void measure_for_replan();
    void replan_from(const StageTimes &measured);
    // Several GPUs: keeps per-layer forward and backward times (-1: not measured) for
    // plan_for_devices, the tail's forward times filled in from the other layers' ratio.
    void measure_layer_times(std::vector<double> forward, std::vector<double> backward,
                             size_t microbatches);
    void rethrow_step_error();
    // The reported loss of a training call: this rank's, or the mean over the ranks if asked.
    double reported_loss(double local);
    // Data parallel, before the first training call: every rank takes rank 0's weights (and
    // buffers), whatever its seed and whatever the caller wrote into them since creation (a
    // binding copies a framework module's weights in after rp_model_create).
    void share_initial_weights();
    // Runs a training call's pipeline (gated, its gradients accumulated and, data parallel,
    // averaged over the ranks), then `after_run` (may be empty); if either fails, the gradients
    // keep no trace of the call.
    void run_training_pipeline(CallContext &ctx, double scale,
                               const std::function<void()> &after_run);
    bool initial_weights_shared_ = false;

    std::string name_;
    uint64_t seed_;
    std::vector<std::unique_ptr<Layer>> layers_;
    ParamStore store_;
    std::vector<Stage> stages_; // the plan of the last call
    std::vector<int> explicit_plan_;
    std::vector<int> explicit_backward_plan_; // empty: the forward stages
    int64_t gpu_memory_cap_ = 0;
    double plan_cap_ = 0; // bytes the planner fits a device's stages into; 0: no limit
    std::vector<double> layer_costs_; // estimated, then measured by the GPU training calls
    // Several GPUs, standard mode: per layer, the compute times the re-planning call measured in
    // a forward job and in a backward job or the tail, and that call's microbatch count
    // (plan_for_devices); empty until then.
    std::vector<double> layer_forward_ms_, layer_backward_ms_;
    size_t measured_microbatches_ = 0;
    std::vector<LayerFootprint> footprints_;
    using PlanKey = std::tuple<int64_t, int, int>; // tokens per microbatch, grain, use
    std::map<PlanKey, std::vector<Stage>> plans_;
    PlanKey last_plan_key_{0, 0, static_cast<int>(StageUse::Fused)};
    // GPU training calls re-plan once, at the kReplanAfterCalls-th call, from each stage's
    // fastest time in those calls (measure_for_replan says why not the first or the second).
    static constexpr int kReplanAfterCalls = 3;
    int calls_since_plan_ = 0; // GPU training calls since the automatic plan was (re)set
    std::optional<StageTimes> replan_times_; // their fastest per stage so far
    std::unordered_set<std::string> checked_shapes_; // input signatures that passed check_shapes
    RunConfig run_config_;
    Pipeline pipeline_;
    uint64_t training_calls_ = 0;
    int64_t enqueued_ = 0;  // steps handed to the optimizer thread
    int64_t published_ = 0; // step whose weights the devices compute with
    bool grads_zero_ = true; // every accumulated-gradient buffer holds zeros
    bool skip_nonfinite_steps_;
    std::atomic<int64_t> nonfinite_skips_{0};
    int64_t nonfinite_losses_ = 0;
    std::unique_ptr<DataParallel> dp_; // before gradients_, whose thread uses it
    HostTimeline timeline_;
    GradFlags flags_{store_.size()};
    // What the running step's gradients hold (run_step, on the optimizer thread; null between
    // steps): a step callback's grad_received reads it, as flags_ already serves the next step.
    const std::vector<uint8_t> *running_step_grads_ = nullptr;
    GradAccumulator gradients_{store_, flags_, timeline_};
    std::unique_ptr<BuiltinOptimizer> builtin_;
    std::optional<OptimizerSettings> in_call_; // in-call steps' settings; none: explicit steps
    // In-call steps split the lookup table's update (RP_DEFER_TABLE_ROWS, read when they are
    // switched on; default on).
    bool defer_table_rows_ = true;
    // In-call steps take an embedding's row gradients (RP_IN_CALL_ROW_GRADIENTS, read likewise;
    // "0": the dense gradient, to measure what the rows give).
    bool in_call_row_gradients_ = true;
    int64_t lookup_table_ = -1; // find_lookup_table()
    CallRows call_rows_;        // what each in-call training call posts for the step before it
    GradScaler scaler_;
    StepGate gate_{store_.size()}; // memory-saving mode: which step each parameter holds
    std::unique_ptr<PendingBackward> pending_;
    StepRunner runner_{!store_.saving()}; // last member: its thread stops first
};

} // namespace rp
