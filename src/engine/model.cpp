// The Model: construction (devices, parameter store, memory cap), the calls (forward, the fused
// training call), optimizer steps and the timing record. Its stage plans are in model_plans.cpp,
// the non-fused training pair in model_split_training.cpp.
#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "base/env_switch.h"
#include "base/error.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "engine/cuda_memory.h"

namespace rp {
namespace {

std::vector<at::Device> choose_devices(const ModelOptions &o) {
    const int gpus = visible_cuda_devices();
    bool cuda =
        o.device_kind == DeviceKind::Cuda || (o.device_kind == DeviceKind::Auto && gpus > 0);
    if (o.device_kind == DeviceKind::Cuda && gpus == 0)
        fail(ErrorKind::Cuda, "GPU devices were asked for but no CUDA GPU is visible");
    std::vector<at::Device> devices;
    if (cuda) {
        int n = o.num_devices > 0 ? o.num_devices : gpus;
        require(n <= gpus, std::to_string(n) + " GPUs were asked for but only " +
                               std::to_string(gpus) + " are visible");
        for (int i = 0; i < n; ++i)
            devices.emplace_back(at::kCUDA, static_cast<c10::DeviceIndex>(i));
    } else {
        int n = o.num_devices > 0 ? o.num_devices : 1;
        for (int i = 0; i < n; ++i)
            devices.emplace_back(at::kCPU);
    }
    return devices;
}

// Page-locking only helps uploads to GPUs; CPU devices read the weights where they are.
HostMemory host_memory_for(const ModelOptions &o) {
    bool gpus = o.device_kind != DeviceKind::Cpu && visible_cuda_devices() > 0;
    if (!gpus || o.pin_mode == PinMode::Off)
        return HostMemory::Pageable;
    return o.pin_mode == PinMode::Alloc ? HostMemory::Pinned : HostMemory::Registered;
}

// Pinned staging memory lent gradients may hold at once: an eighth of what the host has left,
// at most 8 GiB (Qwen3-8B's first stage's gradients are about 3.5 GB; Qwen3-1.7B's whole
// gradient in bf16, 3.4 GB).
int64_t staging_lend_limit() {
    const int64_t available = available_host_memory().bytes;
    return std::min<int64_t>(int64_t{8} << 30, available > 0 ? available / 8 : 0);
}

} // namespace

int visible_cuda_devices() { return at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0; }

Model::Model(std::vector<std::unique_ptr<Layer>> layers, const ModelOptions &o)
    : name_(o.name), seed_(o.seed), layers_(std::move(layers)),
      store_(layers_, o.model_dtype, o.seed, host_memory_for(o), o.host_memory_mode),
      run_config_(o.run_config), pipeline_(choose_devices(o)),
      skip_nonfinite_steps_(o.skip_nonfinite_steps),
      scaler_(o.grad_scale >= 0 ? o.grad_scale : (o.model_dtype == at::kHalf ? 65536.0 : 0.0),
              o.grad_scale_growth_interval) {
    explicit_plan_ = o.stage_plan;
    lookup_table_ = find_lookup_table();
    for (auto &layer : layers_)
        layer->drop_initial_values();
    if (o.data_parallel.world_size != 0) {
        std::vector<at::Device> devices;
        for (size_t d = 0; d < num_devices(); ++d)
            devices.push_back(pipeline_.device(d));
        dp_ = DataParallel::join(o.data_parallel, name_, devices);
        if (!dp_->reduces_on_device())
            gradients_.set_data_parallel(dp_.get());
        else // waits for the GPUs must notice a collective that a dead rank left hanging
            pipeline_.set_wait_watch([dp = dp_.get()] { dp->watch_device_collectives(); });
    }
    // Gradients are read where their downloads landed (ParamStore::lend_grad, in-call steps).
    gradients_.set_lend_limit(staging_lend_limit());
    if (has_cuda_devices()) {
        gpu_memory_cap_ = o.gpu_memory_cap;
        if (gpu_memory_cap_ == 0) {
            int64_t smallest_free = -1;
            for (size_t d = 0; d < num_devices(); ++d) {
                int64_t free_b = gpu_memory_stats(pipeline_.device(d).index()).free_bytes;
                smallest_free = smallest_free < 0 ? free_b : std::min(smallest_free, free_b);
            }
            gpu_memory_cap_ = smallest_free / 10 * 8;
        } else {
            // An explicit cap is a promise: the allocator enforces it, so exceeding it is an
            // out-of-memory error rather than a silent overrun.
            for (size_t d = 0; d < num_devices(); ++d)
                limit_gpu_memory(pipeline_.device(d).index(), gpu_memory_cap_);
        }
    }
    plan_cap_ = static_cast<double>(has_cuda_devices() ? gpu_memory_cap_ : o.gpu_memory_cap);
    grant_workspaces(); // before the footprints: a workspace may be sized to its grant
    // A layer's fixed device footprint: its weights and their gradients in the model dtype, plus
    // its own workspace; its activations per token in the model dtype (unknown: as the layer
    // before).
    const double dtype_bytes = static_cast<double>(c10::elementSize(store_.model_dtype()));
    double previous_activation = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
        LayerFootprint f;
        f.fixed_bytes = layer_param_bytes(l) + layers_[l]->workspace_bytes();
        double a = layers_[l]->activation_bytes_per_token(dtype_bytes);
        f.activation_bytes_per_token = a >= 0 ? a : previous_activation;
        previous_activation = f.activation_bytes_per_token;
        footprints_.push_back(f);
        layer_costs_.push_back(layers_[l]->cost_estimate());
    }
    stages_ = make_plan(0, RecomputeGrain::Stage, StageUse::Fused);
    log(LogLevel::Info, name_ + ": " + std::to_string(layers_.size()) + " layers, " +
                            std::to_string(store_.size()) + " parameters tensors, " +
                            std::to_string(stages_.size()) + " stages on " +
                            std::to_string(pipeline_.num_devices()) +
                            (has_cuda_devices() ? " GPU(s)" : " CPU device(s)"));
}

Model::~Model() {
    try {
        runner_.wait_for(enqueued_);
    } catch (...) {
    }
    try {
        pipeline_.wait_for_next_call_uploads(); // they read host memory freed after this
    } catch (...) {
    }
}

void Model::check_shapes_once(const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                              const Loss *loss) {
    // The check depends only on shapes, dtypes and the loss kind: remember what passed, so the
    // microbatches of a call and the calls of a training loop pay for it once (running 30
    // layers on an empty batch on the host costs ~100 ms for an LLM).
    std::string key = loss ? std::to_string(static_cast<int>(loss->kind)) : "forward";
    for (const at::Tensor &t : inputs)
        key += "|" + c10::str(t.sizes()) + c10::toString(t.scalar_type());
    if (labels.defined())
        key += "|labels" + c10::str(labels.sizes()) + c10::toString(labels.scalar_type());
    if (checked_shapes_.count(key))
        return;
    check_shapes(layers_, store_, inputs, labels, loss);
    if (checked_shapes_.size() >= 256)
        checked_shapes_.clear(); // bounded: a loop over ever-new shapes re-checks, never grows
    checked_shapes_.insert(std::move(key));
}

ResolvedRunConfig Model::resolve_run_config(const RunConfig &call) const {
    ResolvedRunConfig r = ResolvedRunConfig::resolve(RunConfig::overlay(run_config_, call),
                                                     static_cast<int>(num_devices()));
    check_output_device(r.output_device);
    return r;
}

void Model::check_output_device(const at::Device &d) const {
    if (d.is_cuda())
        require(d.index() < visible_cuda_devices(),
                "output device cuda:" + std::to_string(d.index()) + " does not exist (" +
                    std::to_string(visible_cuda_devices()) + " GPUs visible)");
}

void Model::check_index_ranges(const std::vector<at::Tensor> &inputs,
                               const at::Tensor &labels) const {
    // Checked on the host: on a GPU an index out of range is a device-side assertion that
    // poisons the whole process.
    const at::Tensor &ids = inputs.at(0);
    const int64_t ids_limit = layers_.front()->input_index_limit();
    if (ids_limit > 0 && !at::isFloatingType(ids.scalar_type()) && ids.numel() > 0) {
        at::Tensor bad = ids.lt(0).logical_or(ids.ge(ids_limit));
        if (bad.any().item<bool>())
            fail(ErrorKind::InvalidArgument,
                 "input 0 holds token id " +
                     std::to_string(ids.masked_select(bad)[0].item<int64_t>()) +
                     " outside the vocabulary [0, " + std::to_string(ids_limit) + ")");
    }
    const int64_t label_limit = layers_.back()->label_index_limit();
    if (label_limit > 0 && labels.defined() && !at::isFloatingType(labels.scalar_type()) &&
        labels.numel() > 0) {
        at::Tensor bad =
            labels.ne(kIgnoreLabel).logical_and(labels.lt(0).logical_or(labels.ge(label_limit)));
        if (bad.any().item<bool>())
            fail(ErrorKind::InvalidArgument,
                 "labels hold " + std::to_string(labels.masked_select(bad)[0].item<int64_t>()) +
                     ", neither " + std::to_string(kIgnoreLabel) +
                     " (no target) nor a token id in [0, " + std::to_string(label_limit) + ")");
    }
}

// The causal-LM loss has one normaliser for the whole call, the number of tokens with a target,
// so that the microbatch losses add up to the batch mean (docs/semantics.md).
static Loss normalised_causal_lm(Loss loss, const at::Tensor &labels, const at::Tensor &ids) {
    require(labels.defined(), "the causal-LM loss needs labels (token ids, -100 for none)");
    require(!at::isFloatingType(labels.scalar_type()) && labels.dim() == 2,
            "the causal-LM loss needs integer labels [batch, seq], got " +
                std::string(c10::toString(labels.scalar_type())) + " " + c10::str(labels.sizes()));
    require(labels.sizes() == ids.sizes(),
            "the causal-LM loss needs labels of the shape of input 0 " + c10::str(ids.sizes()) +
                ", got " + c10::str(labels.sizes()));
    loss.scale /= static_cast<double>(std::max<int64_t>(1, causal_lm_target_count(labels)));
    return loss;
}

std::vector<at::Tensor> Model::finish_outputs(std::vector<std::vector<at::Tensor>> per_mb,
                                              bool merge,
                                              const std::vector<at::Tensor> &inputs) const {
    // Merged: output k of every microbatch joined into one tensor, in output order. Otherwise
    // microbatch-major: every output of microbatch 0, then of microbatch 1, ...
    std::vector<at::Tensor> outputs;
    if (merge) {
        const size_t n = per_mb.empty() ? 0 : per_mb.front().size();
        for (size_t k = 0; k < n; ++k) {
            std::vector<at::Tensor> pieces;
            for (const auto &mb : per_mb) {
                require(mb.size() == n && mb[k].defined(),
                        "the microbatches gave different numbers of outputs; merging needs the "
                        "same structure from each (turn merging off)");
                pieces.push_back(mb[k]);
            }
            outputs.push_back(merge_outputs(pieces));
        }
    } else {
        for (auto &mb : per_mb)
            for (at::Tensor &t : mb)
                outputs.push_back(std::move(t));
    }
    // Outputs are the caller's to keep: never views of the borrowed inputs (a reshape-only
    // model returns them).
    for (at::Tensor &t : outputs)
        for (const at::Tensor &in : inputs)
            if (t.defined() && t.storage().is_alias_of(in.storage())) {
                t = t.clone();
                break;
            }
    return outputs;
}

Microbatches Model::begin_forward_call(const std::vector<at::Tensor> &inputs,
                                       const ResolvedRunConfig &cfg) {
    // The trace of this call must not pair its device spans with an earlier call's host spans.
    timeline_.begin_call();
    check_index_ranges(inputs, at::Tensor());
    Microbatches mb = split_microbatches(inputs, at::Tensor(), cfg);
    for (const auto &mb_inputs : mb.inputs)
        check_shapes_once(mb_inputs, at::Tensor(), nullptr);
    return mb;
}

std::vector<at::Tensor> Model::forward(const std::vector<at::Tensor> &inputs,
                                       const RunConfig &call) {
    const ResolvedRunConfig cfg = resolve_run_config(call);
    Microbatches mb = begin_forward_call(inputs, cfg);
    plan_call(tokens_per_microbatch(mb), cfg.grain, StageUse::Inference);
    CallContext ctx{layers_, stages_, stages_, store_, mb}; // nothing kept for a backward
    ctx.seed = seed_;
    ctx.training = false;
    ctx.output_device = cfg.output_device;
    ctx.grain = cfg.grain;
    gate_call(ctx);
    offer_next_call_weights(ctx);
    pipeline_.run(ctx);
    return finish_outputs(std::move(ctx.outputs), cfg.merge_output, inputs);
}

double Model::forward_backward(const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                               const Loss &call_loss, const RunConfig &call,
                               std::vector<at::Tensor> *outputs) {
    if (in_call_) {
        check_step_in_call();
        rethrow_step_error(); // nothing else reports an earlier in-call step's failure
    }
    share_initial_weights();
    timeline_.begin_call();
    std::optional<HostSpan> phase(std::in_place, timeline_, "caller", "prepare");
    check_index_ranges(inputs, labels);
    const Loss loss = call_loss.kind == LossKind::CausalLm
                          ? normalised_causal_lm(call_loss, labels, inputs.at(0))
                          : call_loss;
    ResolvedRunConfig cfg = resolve_run_config(call);
    Microbatches mb = split_microbatches(inputs, labels, cfg);
    for (size_t m = 0; m < mb.inputs.size(); ++m)
        check_shapes_once(mb.inputs[m], mb.labels[m], &loss);
    phase.reset();
    // fp16: back-propagate a scaled loss so small gradients survive, and unscale on the host.
    const double scale = scaler_.enabled() ? scaler_.scale() : 1.0;
    Loss scaled = loss;
    scaled.scale *= scale;
    plan_call(tokens_per_microbatch(mb), cfg.grain, StageUse::Fused);
    const std::vector<Stage> backward_stages = backward_plan_for(stages_);
    if (backward_stages.back().first_layer != stages_.back().first_layer)
        fail(ErrorKind::InvalidArgument,
             "the backward stage plan ends with layers " +
                 std::to_string(backward_stages.back().first_layer) + " to " +
                 std::to_string(layers_.size() - 1) + " and the forward stage plan with layers " +
                 std::to_string(stages_.back().first_layer) + " to " +
                 std::to_string(layers_.size() - 1) +
                 ": a fused training call runs that last stage once, forward, loss and backward "
                 "without recompute, so both plans must end with the same stage");
    CallContext ctx{layers_, stages_, backward_stages, store_, mb};
    ctx.seed = seed_;
    ctx.call_index = training_calls_++;
    ctx.training = true;
    ctx.kind = CallKind::Fused;
    ctx.grain = cfg.grain;
    ctx.loss = &scaled;
    ctx.output_device = cfg.output_device;
    ctx.keep_outputs = outputs != nullptr;
    ctx.table_rows = table_rows_of(mb);
    phase.reset();
    run_training_pipeline(ctx, scale, nullptr);
    phase.emplace(timeline_, "caller", "loss");
    measure_for_replan();
    double total = 0.0;
    for (const at::Tensor &l : ctx.losses)
        total += l.item<double>() / scale;
    total = reported_loss(total);
    if (!std::isfinite(total)) {
        ++nonfinite_losses_;
        log(LogLevel::Warn, name_ + ": training call " + std::to_string(ctx.call_index) +
                                ": the loss is " + std::to_string(total) +
                                " (inputs or labels holding inf or nan, or an overflow)");
    }
    if (outputs)
        *outputs = finish_outputs(std::move(ctx.outputs), cfg.merge_output, inputs);
    return total;
}

void Model::share_initial_weights() {
    if (!dp_ || initial_weights_shared_)
        return;
    synchronize();
    std::vector<at::Tensor> masters;
    for (size_t i = 0; i < store_.size(); ++i)
        masters.push_back(store_.at(i).master);
    dp_->broadcast(masters);
    store_.refresh_live_from_master();
    initial_weights_shared_ = true;
}

void Model::run_training_pipeline(CallContext &ctx, double scale,
                                  const std::function<void()> &after_run) {
    ctx.gradients = &gradients_;
    gate_call(ctx);
    offer_next_call_weights(ctx);
    // Data parallel on GPUs: the ranks' jobs meet pairwise in per-GPU collectives, so every
    // rank must run this call's job layout. Each parameter's jobs: the reducer waits for them,
    // and the accumulator does not lend a gradient a second job adds to.
    const bool on_device = dp_ && dp_->reduces_on_device();
    if (on_device) {
        dp_->check_same(job_layout_fingerprint(ctx, num_devices()), "the stages of this call");
        ctx.device_reduction = dp_.get();
    }
    const bool buffers_were_zero = grads_zero_;
    gradients_.begin_call(grads_zero_, 1.0 / scale, gradient_jobs_per_param(ctx));
    // In-call steps: the call's gradients are the step's, whether it succeeds or not (those
    // handed over are updated, the rest dropped), so the buffers end zero either way.
    struct CloseFeed {
        Model &m;
        std::shared_ptr<FinalFeed> feed;
        bool ok = false;
        ~CloseFeed() {
            if (!feed)
                return;
            m.flags_.clear();
            m.grads_zero_ = true;
            feed->close(!ok);
        }
    } in_call{*this, in_call_ && ctx.kind == CallKind::Fused ? start_in_call_step(ctx) : nullptr};
    // Averaged on the devices, gradients go through dense collectives.
    ctx.row_gradients =
        gradients_.takes_row_gradients() && !on_device && (!in_call.feed || in_call_row_gradients_);
    {
        HostSpan span(timeline_, "caller", "pipeline");
        try {
            pipeline_.run(ctx);
            if (after_run)
                after_run();
        } catch (...) {
            gradients_.end_call(false); // a failed call leaves no trace in the gradients
            if (on_device)
                dp_->finish_device_collectives(/*report_failure=*/false); // the call's error wins
            throw;
        }
    }
    HostSpan drain(timeline_, "caller", "gradient drain");
    gradients_.end_call(true);
    if (on_device) {
        try {
            dp_->finish_device_collectives(/*report_failure=*/true);
        } catch (...) {
            // The averages that arrived may be garbage: no trace. In-call steps have taken them
            // already (the group now refuses work; the docs say to reload the weights).
            if (buffers_were_zero && !in_call.feed)
                store_.zero_grads();
            throw;
        }
    }
    grads_zero_ = false;
    in_call.ok = true;
}

double Model::reported_loss(double local) {
    return dp_ && dp_->global_loss() ? dp_->mean(local) : local;
}

void Model::rethrow_step_error() {
    if (std::exception_ptr e = runner_.take_error()) {
        try {
            std::rethrow_exception(e);
        } catch (const Error &err) {
            fail(err.kind(), std::string("an earlier optimizer step failed: ") + err.what());
        } catch (const std::exception &err) {
            fail(ErrorKind::Callback,
                 std::string("an earlier optimizer step failed: ") + err.what());
        }
    }
}

void Model::gate_call(CallContext &ctx) const {
    // Memory-saving mode has one weight copy: a stage may go up only once the steps queued so
    // far have updated it (and consumed its gradients, which this call will write).
    if (store_.saving()) {
        ctx.gate = &gate_;
        ctx.gate_step = enqueued_;
    }
}

void Model::offer_next_call_weights(CallContext &ctx) const {
    // RP_NEXT_CALL_WEIGHTS=0 turns this off, to measure what it gives.
    static const bool enabled = env_switch_on("RP_NEXT_CALL_WEIGHTS");
    // Memory-saving mode has one weight copy, which the next step rewrites in place.
    if (!enabled || store_.saving() || pipeline_.device(0).is_cpu())
        return;
    // A step handed over and not yet published writes `staged`, which the next rp_step swaps
    // in (one publish); with none, the next call reads `live` as it is now.
    const bool pending = published_ < enqueued_;
    const int64_t step = enqueued_;
    const uint64_t version = store_.weights_version() + (pending ? 1 : 0);
    ctx.gpu_memory_cap = gpu_memory_cap_;
    ctx.next_call_weights = [this, pending, step, version](const std::vector<size_t> &params,
                                                           uint64_t *expected) {
        std::vector<at::Tensor> sources;
        std::vector<size_t> trained;
        for (size_t pi : params) {
            const Param &p = store_.at(pi);
            if (p.role == ParamRole::Buffer)
                return std::vector<at::Tensor>(); // a forward job may write it before then
            if (p.trainable())
                trained.push_back(pi);
            sources.push_back(pending && p.staged.defined() ? p.staged : p.live);
        }
        if (pending && !gate_.is_open(trained, step))
            return std::vector<at::Tensor>(); // the step has not written them all yet
        *expected = version;
        return sources;
    };
}

void Model::publish_completed_step() {
    if (published_ == enqueued_)
        return;
    runner_.wait_for(enqueued_);
    if (!store_.saving())
        store_.publish_staged();
    published_ = enqueued_;
}

void Model::check_explicit_step() const {
    if (in_call_)
        fail(ErrorKind::State, name_ + " steps inside its training calls "
                                       "(rp_model_set_step_in_call); switch that off first to "
                                       "step explicitly");
}

void Model::step(StepUpdate update, bool async) {
    check_explicit_step();
    // Make the previous step's weights the ones in use, then hand this step the gradients
    // accumulated since: in standard mode by swapping buffers (the next call runs on the weights
    // before this step: staleness one); in memory-saving mode the step consumes `grad` in place
    // and opens each parameter to the next call as it goes (StepGate).
    publish_completed_step();
    rethrow_step_error();
    if (!store_.saving())
        store_.swap_grads();
    grads_zero_ = true; // the buffer the next call accumulates into is zeroed by the step
    ++enqueued_;
    runner_.submit([this, update = std::move(update), grads = flags_.take(), number = enqueued_] {
        run_step(update, grads, number);
    });
    if (!async) {
        publish_completed_step();
        rethrow_step_error();
    }
}

void Model::set_grad_scaler(double initial_scale, int growth_interval) {
    if (in_call_ && initial_scale > 0)
        fail(ErrorKind::State, "loss scaling needs every gradient before a step's first update, "
                               "which in-call steps do not wait for; switch them off first");
    // The optimizer thread reads the scaler in step_may_proceed: no step may be in flight.
    runner_.wait_for(enqueued_);
    scaler_.reset(initial_scale, growth_interval);
}

void Model::set_skip_nonfinite_steps(bool skip) {
    runner_.wait_for(enqueued_); // as above: read by step_may_proceed
    skip_nonfinite_steps_ = skip;
}

bool Model::step_may_proceed(const GradFlags::Snapshot &grads, int64_t number) {
    if (scaler_.enabled()) {
        if (scaler_.step_may_proceed(step_grads()))
            return true;
        log(LogLevel::Info, name_ + ": gradients overflowed; step skipped, loss scale now " +
                                std::to_string(scaler_.scale()));
        return false;
    }
    if (!grads.nonfinite || !skip_nonfinite_steps_)
        return true;
    ++nonfinite_skips_;
    log(LogLevel::Warn, name_ + ": step " + std::to_string(number) +
                            " skipped: the gradients hold inf or nan; the weights are unchanged");
    return false;
}

void Model::run_step(const StepUpdate &update, const GradFlags::Snapshot &grads, int64_t number) {
    HostSpan span(timeline_, "optimizer", "step " + std::to_string(number));
    const bool saving = store_.saving();
    std::vector<bool> finished(store_.size(), false);
    auto param_done = [&](size_t i, bool published) {
        if (saving)
            param_finished(i, published, finished, number);
        else { // the next call reads `staged` once the step is published
            finished[i] = published;
            if (published) // final: the next call's weights may go up before then
                gate_.open(i, number);
        }
    };
    // Whatever the update does, the weight copy and the gradient buffer are left ready for the
    // next call; the error (if any) is reported by the next waiting call.
    std::exception_ptr error;
    running_step_grads_ = &grads.has_grad;
    try {
        if (step_may_proceed(grads, number))
            update(param_done, grads.has_grad);
    } catch (...) {
        error = std::current_exception();
    }
    running_step_grads_ = nullptr;
    finish_unfinished(finished, number);
    if (error)
        std::rethrow_exception(error);
}

void Model::param_finished(size_t i, bool published, std::vector<bool> &finished, int64_t number) {
    if (!published)
        store_.finish_step(i);
    finished[i] = true;
    gate_.open(i, number);
}

void Model::finish_unfinished(const std::vector<bool> &finished, int64_t number) {
    for (size_t i = 0; i < store_.size(); ++i)
        if (!finished[i]) {
            if (store_.saving())
                store_.finish_step(i);
            else
                store_.finish_standard_step(i);
        }
    gate_.open_all(number);
    if (!store_.saving())
        store_.release_step_grads();
}

std::vector<at::Tensor> Model::step_grads() {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < store_.size(); ++i) {
        store_.materialize_step_grad(i); // nothing is lent in memory-saving mode
        grads.push_back(store_.step_grad(i));
    }
    return grads;
}

std::vector<at::Tensor> Model::step_grads_as_lent() const {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < store_.size(); ++i) {
        const Param &p = store_.at(i);
        grads.push_back(p.step_landed.defined() ? p.step_landed : store_.step_grad(i));
    }
    return grads;
}

std::vector<AddedRows> Model::step_grads_added_rows() const {
    std::vector<AddedRows> rows;
    for (size_t i = 0; i < store_.size(); ++i) {
        const Param &p = store_.at(i);
        rows.push_back(p.step_landed_rows.defined() ? AddedRows{p.step_grad, p.step_landed_rows}
                                                    : AddedRows{});
    }
    return rows;
}

at::Tensor Model::exposed_grad(size_t i) {
    if (on_optimizer_thread()) {
        store_.materialize_step_grad(i);
        return store_.step_grad(i);
    }
    flags_.mark(i); // the view may be written through: the next step counts it as a gradient
    store_.materialize_grad(i);
    return store_.at(i).grad;
}

bool Model::grad_received(size_t i) const {
    if (on_optimizer_thread() && running_step_grads_)
        return (*running_step_grads_)[i] != 0;
    return flags_.has(i);
}

BuiltinOptimizer &Model::builtin_optimizer(OptimizerKind kind) {
    if (!builtin_)
        builtin_ = std::make_unique<BuiltinOptimizer>(kind, store_.saving());
    else if (builtin_->kind() != kind)
        fail(ErrorKind::State, std::string("the model already holds ") +
                                   (builtin_->kind() == OptimizerKind::AdamW ? "AdamW" : "SGD") +
                                   " state; use the same optimizer kind for every step");
    return *builtin_;
}

void Model::builtin_targets(std::vector<at::Tensor> &params, std::vector<at::Tensor> &lives) const {
    for (size_t i = 0; i < store_.size(); ++i) {
        const Param &p = store_.at(i);
        // Frozen parameters and buffers: no state, never updated (undefined).
        params.push_back(p.trainable() ? p.master : at::Tensor());
        // bf16 weight copies are refreshed inside the update's own pass: in saving mode the one
        // the devices read, in the standard mode the staged one the next publish swaps in.
        const at::Tensor &copy = store_.saving() ? p.live : p.staged;
        const bool fuse = p.trainable() && copy.defined() && copy.scalar_type() == at::kBFloat16;
        lives.push_back(fuse ? copy : at::Tensor());
    }
}

void Model::step_builtin(const OptimizerSettings &settings, bool async) {
    check_explicit_step(); // before the optimizer is created
    BuiltinOptimizer *opt = &builtin_optimizer(settings.kind);
    step(
        [this, opt, settings](const ParamDone &param_done, const std::vector<uint8_t> &has_grad) {
            StepArrays a;
            builtin_targets(a.params, a.lives);
            a.has_grad = has_grad;
            // AdamW reads a lent bf16 gradient where it landed, with any rows added to it in
            // fp32 (adamw_update_publish); SGD reads fp32.
            if (settings.kind == OptimizerKind::AdamW) {
                a.grads = step_grads_as_lent();
                a.added_rows = step_grads_added_rows();
            } else {
                a.grads = step_grads();
            }
            opt->step(a, settings, param_done);
        },
        async);
}

void Model::check_step_in_call() const {
    if (!store_.saving())
        fail(ErrorKind::State,
             "in-call steps need RP_HOST_MEMORY_SAVING: in the standard mode an asynchronous "
             "rp_step already runs behind the whole next call");
    if (scaler_.enabled())
        fail(ErrorKind::State, "in-call steps do not combine with loss scaling, whose rule "
                               "needs every gradient before a step's first update; switch it "
                               "off (rp_model_set_grad_scaler(model, 0, ...))");
    if (!grads_zero_)
        fail(ErrorKind::State, "the model holds gradients accumulated since its last step; in "
                               "an in-call step each call's gradients are its own: call rp_step "
                               "(with in-call steps off) or rp_zero_grad first");
}

void Model::set_step_in_call(const OptimizerSettings *settings) {
    if (!settings) {
        in_call_.reset();
        return;
    }
    check_step_in_call();
    builtin_optimizer(settings->kind);
    in_call_ = *settings;
    // Both "0": off, to measure what they give.
    defer_table_rows_ = env_switch_on("RP_DEFER_TABLE_ROWS");
    in_call_row_gradients_ = env_switch_on("RP_IN_CALL_ROW_GRADIENTS");
}

std::shared_ptr<FinalFeed> Model::start_in_call_step(const CallContext &ctx) {
    auto feed = std::make_shared<FinalFeed>();
    gradients_.report_final(gradient_jobs_per_param(ctx),
                            [feed](FinalFeed::Batch batch) { feed->push(std::move(batch)); });
    // After gate_call: this call uploads what the previous step left, the next one what this
    // step leaves. The table rows are posted here, where nothing can fail before the step is
    // queued: a call failing earlier has posted nothing that a step could open the table for.
    if (ctx.table_rows.defined())
        call_rows_.post(enqueued_ + 1, ctx.table_rows);
    const int64_t number = ++enqueued_;
    runner_.submit(
        [this, feed, number, settings = *in_call_] { run_in_call_step(settings, *feed, number); });
    return feed;
}

void Model::run_in_call_step(const OptimizerSettings &settings, FinalFeed &feed, int64_t number) {
    StepArrays a; // params, lives and grads for the whole step; the rest per part
    builtin_targets(a.params, a.lives);
    a.grads = step_grads(); // lent downloads stand in while updated
    std::vector<bool> finished(store_.size(), false);
    // Deferred table rows: this call posted the rows it used (model_table_rows.cpp).
    const at::Tensor table_rows = call_rows_.rows_of(number);
    bool next_rows_served = false;
    auto param_done = [&](size_t i, bool published) {
        param_finished(i, published, finished, number);
    };
    size_t updated = 0, nonfinite = 0;
    std::exception_ptr error;
    FinalFeed::Batch batch;
    // Gives the batch's lent downloads back (the memory returns to the pinned pool).
    auto give_back = [&] {
        for (GradAccumulator::FinalGradient &f : batch)
            if (f.landed.defined()) {
                store_.count_lent(-static_cast<int64_t>(f.landed.nbytes()));
                a.grads[f.param] = store_.step_grad(f.param);
            }
        batch.clear();
    };
    while (feed.pop(batch)) {
        if (error) {
            give_back(); // the rest is dropped below; the feed must still be drained
            continue;
        }
        a.which.clear();
        a.has_grad.assign(store_.size(), 0);
        a.lent.assign(store_.size(), 0);
        // The elements this part updates, in its span's name: with the span's length, the trace
        // gives the optimizer's rate in the call, to set beside a step's alone (a table updated
        // by rows counts whole).
        int64_t elements = 0;
        for (const GradAccumulator::FinalGradient &f : batch) {
            a.which.push_back(f.param);
            if (table_rows.defined() && static_cast<int64_t>(f.param) == lookup_table_)
                builtin_->split_next_update(f.param, table_rows);
            nonfinite += f.nonfinite ? 1 : 0;
            a.has_grad[f.param] = f.received && !(f.nonfinite && skip_nonfinite_steps_);
            if (a.has_grad[f.param] && a.params[f.param].defined()) {
                ++updated;
                elements += a.params[f.param].numel();
            }
            if (f.landed.defined()) {
                a.grads[f.param] = f.landed;
                a.lent[f.param] = 1;
            }
        }
        try {
            // One span per part: the trace shows the updates running beside the backward.
            HostSpan span(timeline_, "optimizer",
                          "in-call step " + std::to_string(number) + ": " +
                              std::to_string(a.which.size()) + " parameter(s), " +
                              std::to_string(elements) + " elements");
            builtin_->step(a, settings, param_done);
            serve_next_call_rows(number, next_rows_served);
        } catch (...) {
            error = std::current_exception();
        }
        give_back();
    }
    // The table's rows still deferred: the work for the stretch with no final gradient. In
    // pieces of about 2^22 elements (a millisecond on a GPU host's 32 threads; smaller pieces
    // leave each thread too little to do between wake-ups), so rows the next call posts
    // meanwhile wait for one piece, not for the rest.
    try {
        if (builtin_->has_deferred_rows()) {
            HostSpan span(timeline_, "optimizer",
                          "in-call step " + std::to_string(number) + ": deferred table rows");
            const int64_t width = store_.at(static_cast<size_t>(lookup_table_)).master.size(1);
            const int64_t piece_rows = std::max<int64_t>(1, (int64_t{1} << 22) / width);
            do
                serve_next_call_rows(number, next_rows_served);
            while (!builtin_->finish_deferred_rows(param_done, piece_rows));
        }
    } catch (...) {
        if (!error)
            error = std::current_exception();
    }
    finish_unfinished(finished, number);
    if (nonfinite > 0 && skip_nonfinite_steps_) {
        ++nonfinite_skips_;
        log(LogLevel::Warn, name_ + ": in-call step " + std::to_string(number) + ": " +
                                std::to_string(nonfinite) +
                                " gradient(s) hold inf or nan; those parameters are unchanged");
    }
    if (feed.failed() && updated > 0)
        log(LogLevel::Warn, name_ + ": training call failed after its in-call step " +
                                std::to_string(number) + " had updated " + std::to_string(updated) +
                                " parameter(s) whose gradients were final; they keep the "
                                "update, every other gradient of the call is dropped");
    if (error)
        std::rethrow_exception(error);
}

int64_t Model::host_state_bytes(int64_t *elements) const {
    return store_.state_bytes(elements) + (builtin_ ? builtin_->state_bytes() : 0);
}

void Model::synchronize() {
    runner_.wait_for(enqueued_);
    published_ = enqueued_;
    // Copy rather than swap: the user may have written master weights directly.
    store_.refresh_live_from_master();
    rethrow_step_error();
}

void Model::zero_grad() {
    if (store_.saving())
        runner_.wait_for(enqueued_); // a running step still reads the one gradient buffer
    store_.zero_grads();
    flags_.clear();
    grads_zero_ = true;
}

void Model::load_master(const std::vector<at::Tensor> &values) {
    synchronize();
    pending_.reset(); // its stage inputs were computed with the old weights
    for (size_t i = 0; i < store_.size(); ++i)
        store_.at(i).master.copy_(values[i]);
    store_.refresh_live_from_master();
    zero_grad();
}

} // namespace rp

namespace rp {

std::vector<TraceEvent> Model::trace() const {
    static const char *kinds[] = {"forward", "tail", "backward"};
    // One zero for all: the host clock at the call's start. The device lanes start their clocks
    // as the pipeline starts, within microseconds of the caller's "pipeline" span.
    const auto zero = timeline_.call_start();
    const std::vector<HostTimeline::Span> host = timeline_.spans();
    double device_offset_ms = 0;
    for (const HostTimeline::Span &h : host)
        if (h.thread == "caller" && h.what == "pipeline")
            device_offset_ms = std::chrono::duration<double, std::milli>(h.start - zero).count();
    std::vector<TraceEvent> events;
    for (const JobTrace &job : pipeline_.last_trace())
        for (const TraceSpan &span : job.spans) {
            TraceEvent e;
            e.kind = kinds[static_cast<int>(job.kind)];
            e.name = (job.next_call ? "next call's " : "") + e.kind + " stage " +
                     std::to_string(job.stage) +
                     (job.from_last_call ? " (uploaded by the last call)" : "");
            e.lane = span.what;
            e.device = static_cast<int>(job.device);
            e.start_us = (device_offset_ms + span.start_ms) * 1000.0;
            e.duration_us = (span.end_ms - span.start_ms) * 1000.0;
            e.job = job.job;
            e.stage = job.stage;
            e.bytes = span.bytes;
            e.content = span.content;
            if (span.enqueued_ms >= 0)
                e.enqueued_us = (device_offset_ms + span.enqueued_ms) * 1000.0;
            events.push_back(std::move(e));
        }
    for (const HostTimeline::Span &h : host) {
        TraceEvent e;
        e.name = h.what;
        e.lane = h.thread;
        e.start_us = std::chrono::duration<double, std::micro>(h.start - zero).count();
        e.duration_us = std::chrono::duration<double, std::micro>(h.end - h.start).count();
        events.push_back(std::move(e));
    }
    return events;
}

} // namespace rp
