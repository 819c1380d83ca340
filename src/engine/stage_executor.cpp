#include "engine/stage_executor.h"

#include <optional>

#include <torch/csrc/autograd/variable.h>

#include "base/error.h"
#include "engine/final_gradients.h"
#include "engine/seed.h"

namespace rp {
namespace {

// A stage's weights on the device, as autograd leaves when gradients are wanted (frozen
// parameters and buffers never want one).
struct StageWeights {
    std::vector<std::vector<at::Tensor>> per_layer;
    std::vector<std::pair<size_t, at::Tensor>> leaves;  // (param index, tensor)
    std::vector<std::pair<size_t, at::Tensor>> buffers; // (param index, device tensor)

    // The first job of a call finds its weights still on their way: rather than wait for the
    // whole stage, compute waits for each layer's weights just before that layer first runs
    // (uploads land in layer order). Empty markers: the whole stage was waited for up front.
    DeviceLane *lane = nullptr;
    std::vector<std::shared_ptr<void>> layer_landed; // per layer: its last tensor's marker
    mutable size_t waited_layers = 0;                // layers [0, waited_layers) waited for

    void before_layer(size_t local) const {
        if (local < waited_layers || local >= layer_landed.size())
            return;
        lane->use(Transfer{{}, layer_landed[local], {}});
        waited_layers = local + 1;
    }
};

StageWeights make_leaves(const CallContext &ctx, const Stage &stage, const Transfer &uploaded,
                         bool requires_grad) {
    StageWeights w;
    size_t next = 0;
    const bool per_layer_wait = uploaded.landed.size() == uploaded.tensors.size();
    for (size_t l = stage.first_layer; l < stage.end_layer; ++l) {
        std::vector<at::Tensor> params;
        for (size_t pi : ctx.store.layer_params(l)) {
            const Param &p = ctx.store.at(pi);
            // detach(): a fresh tensor object even when no copy happened (CPU devices), so
            // autograd flags never touch the store's tensors. Buffers stay the uploaded tensor
            // itself: layers update them in place.
            at::Tensor t = uploaded.tensors[next++];
            if (p.role == ParamRole::Buffer) {
                w.buffers.emplace_back(pi, t);
            } else {
                t = t.detach();
                if (requires_grad && p.trainable()) {
                    t.requires_grad_(true);
                    w.leaves.emplace_back(pi, t);
                }
            }
            params.push_back(t);
        }
        w.per_layer.push_back(std::move(params));
        if (per_layer_wait)
            w.layer_landed.push_back(next > 0 ? uploaded.landed[next - 1] : nullptr);
    }
    return w;
}

// Buffers a forward or tail job updated on the device go back to host memory before the job
// ends (on CPU devices the layers wrote the host copy itself).
void write_back_buffers(CallContext &ctx, const StageWeights &w, DeviceLane &lane, size_t job) {
    std::vector<size_t> index;
    std::vector<at::Tensor> device;
    for (const auto &[pi, t] : w.buffers)
        if (!t.is_same(ctx.store.at(pi).live)) {
            index.push_back(pi);
            device.push_back(t);
        }
    if (device.empty())
        return;
    Transfer host = lane.download(device, job);
    lane.wait(host);
    for (size_t i = 0; i < index.size(); ++i)
        ctx.store.at(index[i]).live.copy_(host.tensors[i]);
}

// A host activation (ready after `ready`) on the device: floating tensors in the compute dtype,
// each a fresh leaf.
std::vector<at::Tensor> to_device(DeviceLane &lane, const Transfer &host, size_t job,
                                  at::ScalarType dtype) {
    Transfer d = lane.upload(host, job);
    lane.use(d);
    std::vector<at::Tensor> xs;
    for (const at::Tensor &x : d.tensors) {
        if (!x.defined()) {
            xs.push_back(x);
            continue;
        }
        at::ScalarType target = at::isFloatingType(x.scalar_type()) ? dtype : x.scalar_type();
        xs.push_back(x.to(target).detach());
    }
    return xs;
}

// What travels with microbatch m besides the activation, on the job's device.
struct MicrobatchExtras {
    size_t microbatch = 0;
    at::Device device = at::Device(at::kCPU);
    std::vector<at::Tensor> side_inputs;
    at::Tensor labels; // tail stage of a training call only
};

MicrobatchExtras extras_for(const CallContext &ctx, size_t m, DeviceLane &lane, size_t job,
                            bool tail) {
    MicrobatchExtras e;
    e.microbatch = m;
    e.device = lane.device();
    const std::vector<at::Tensor> &inputs = ctx.microbatches.inputs[m];
    Transfer host;
    for (size_t i = 1; i < inputs.size(); ++i)
        host.tensors.push_back(inputs[i]);
    if (tail)
        host.tensors.push_back(ctx.microbatches.labels[m]);
    if (host.tensors.empty())
        return e;
    Transfer d = lane.upload(host, job);
    lane.use(d);
    e.side_inputs.assign(d.tensors.begin(), d.tensors.begin() + (inputs.size() - 1));
    if (tail)
        e.labels = d.tensors.back();
    return e;
}

LayerContext layer_context(const CallContext &ctx, size_t layer, const MicrobatchExtras &e,
                           Phase phase) {
    LayerContext lc;
    lc.training = ctx.training;
    lc.dropout_seed = dropout_seed(ctx.seed, ctx.call_index, layer, e.microbatch);
    lc.side_inputs = &e.side_inputs;
    // Labels reach the layers only for the losses a last layer may fuse (the causal-LM head);
    // with any other loss the model must hand its plain output to that loss.
    const bool fusable =
        ctx.loss && (ctx.loss->kind == LossKind::CausalLm || ctx.loss->kind == LossKind::Output);
    lc.labels = fusable && e.labels.defined() ? &e.labels : nullptr;
    lc.phase = phase;
    lc.microbatch = e.microbatch;
    lc.num_microbatches = ctx.num_microbatches();
    lc.layer_index = layer;
    lc.device = e.device;
    lc.row_gradients = ctx.row_gradients;
    return lc;
}

using Activation = std::vector<at::Tensor>;

Activation run_layer(const CallContext &ctx, const StageWeights &w, const Stage &stage, size_t l,
                     const Activation &x, const MicrobatchExtras &e, Phase phase) {
    w.before_layer(l - stage.first_layer);
    return ctx.layers[l]->forward_list(w.per_layer[l - stage.first_layer], x,
                                       layer_context(ctx, l, e, phase));
}

Activation run_stage(const CallContext &ctx, const StageWeights &w, const Stage &stage,
                     Activation x, const MicrobatchExtras &e, Phase phase) {
    for (size_t l = stage.first_layer; l < stage.end_layer; ++l)
        x = run_layer(ctx, w, stage, l, x, e, phase);
    return x;
}

// Input of stage `stage` for microbatch m: the call's input for the first stage (every input
// for a first layer that takes them all, else input 0), else the previous job's result.
Transfer stage_input(CallContext &ctx, size_t job, size_t stage, size_t m) {
    if (stage == 0) {
        const std::vector<at::Tensor> &inputs = ctx.microbatches.inputs[m];
        if (ctx.layers.front()->takes_all_call_inputs())
            return {inputs, nullptr, {}};
        return {{inputs[0]}, nullptr, {}};
    }
    return ctx.state->take(job - 1, m);
}

// What job `job` hands the next job for microbatch m. When the next job runs on this device it
// takes the device tensors themselves: both enqueue on this device's compute stream, so its
// kernels are ordered after these, and neither a download nor an upload stands between them
// (one GPU: every hand-off; the host round trip of a 65,536-token activation is ~10 ms each way).
// On another GPU that can copy from this one, the device tensors too, ready once the compute so
// far is done: its lane copies them directly (DeviceLane::upload), without the round trip through
// host memory, whose upload also queues behind that GPU's weight copies (bench/RESULTS.md, round
// 16). Otherwise a download to host memory, from which the other device uploads.
Transfer hand_off(const CallContext &ctx, size_t job, DeviceLane &lane, const Activation &ys) {
    if (ctx.next_job_on_same_device(job))
        return Transfer{ys, nullptr, {}};
    if (ctx.peer_hand_offs)
        return Transfer{ys, lane.mark_compute(), {}};
    return lane.download(ys, job);
}

// What a training forward keeps of its stage input `in` for a backward stage, in host memory (it
// must not hold device memory for the rest of the call): `in` itself when it came through host
// memory, else a download of `on_device`, its copy on this job's device (`in` may be on another
// GPU).
Transfer on_host(DeviceLane &lane, const Transfer &in, const Activation &on_device, size_t job) {
    for (const at::Tensor &x : in.tensors)
        if (x.defined() && !x.device().is_cpu())
            return lane.download(on_device, job);
    return in;
}

void maybe_require_grad(Activation &xs, bool wanted) {
    for (at::Tensor &x : xs)
        if (wanted && x.defined() && at::isFloatingType(x.scalar_type()))
            x.requires_grad_(true);
}

Activation grads_of(const Activation &xs) {
    Activation g;
    for (const at::Tensor &x : xs)
        g.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    return g;
}

Activation detached(const Activation &xs) {
    Activation out;
    for (const at::Tensor &x : xs)
        out.push_back(x.defined() ? x.detach() : x);
    return out;
}

// A recompute must give what the forward gave: the gradients arriving from the next stage (or
// layer) were computed for the forward's outputs. Caller-defined code can break this (outputs
// that depend on state the forward changed); say where instead of failing inside autograd.
void check_recompute_matches(const Activation &ys, const Activation &grads,
                             const std::string &where) {
    auto differs = [&](const std::string &what) {
        const std::string message =
            where + ": the recompute gave outputs that differ from the forward's (" + what +
            "); a layer's outputs must not change between its forward and its recompute";
        fail(ErrorKind::Callback, message);
    };
    if (ys.size() != grads.size())
        differs(std::to_string(ys.size()) + " outputs, the forward gave " +
                std::to_string(grads.size()));
    for (size_t i = 0; i < ys.size(); ++i) {
        if (!grads[i].defined() || !ys[i].defined())
            continue;
        if (ys[i].sizes() != grads[i].sizes())
            differs("output " + std::to_string(i) + " has shape " + c10::str(ys[i].sizes()) +
                    ", the forward's " + c10::str(grads[i].sizes()));
        if (at::isFloatingType(ys[i].scalar_type()) != at::isFloatingType(grads[i].scalar_type()))
            differs("output " + std::to_string(i) + " is " +
                    std::string(c10::toString(ys[i].scalar_type())) + ", the forward's " +
                    std::string(c10::toString(grads[i].scalar_type())));
    }
}

std::string layers_of(const CallContext &ctx, size_t first, size_t end) {
    std::string s = end - first == 1 ? "layer " : "layers ";
    for (size_t l = first; l < end; ++l)
        s += (l > first ? ", " : "") + std::to_string(l) + " (" + ctx.layers[l]->type() + ")";
    return s;
}

// Back-propagates from every output that has a graph and a gradient.
void backward_if_needed(const Activation &ys, const Activation &grads) {
    std::vector<at::Tensor> roots, seeds;
    for (size_t i = 0; i < ys.size() && i < grads.size(); ++i)
        if (ys[i].defined() && ys[i].requires_grad() && grads[i].defined()) {
            roots.push_back(ys[i]);
            seeds.push_back(grads[i]);
        }
    if (!roots.empty())
        torch::autograd::backward(roots, seeds);
}

std::vector<at::Tensor> to_output_device(const CallContext &ctx, DeviceLane &lane,
                                         const Activation &ys, size_t job) {
    if (ctx.output_device.is_cpu())
        return lane.download(ys, job).tensors;
    std::vector<at::Tensor> out;
    for (const at::Tensor &y : ys)
        out.push_back(y.to(ctx.output_device, /*non_blocking=*/true));
    return out;
}

void run_forward(CallContext &ctx, size_t job, size_t s, DeviceLane &lane, const StageWeights &w) {
    const Stage &stage = ctx.stages[s];
    const bool last = s + 1 == ctx.stages.size();
    at::NoGradGuard no_grad;
    for (size_t m = 0; m < ctx.num_microbatches(); ++m) {
        Transfer in = stage_input(ctx, job, s, m);
        Activation y = to_device(lane, in, job, ctx.store.model_dtype());
        MicrobatchExtras extras = extras_for(ctx, m, lane, job, false);
        lane.compute_begin(job);
        for (size_t l = stage.first_layer; l < stage.end_layer; ++l) {
            // A training forward keeps each backward stage's input: the one it received where
            // the stages start together, else a download of the activation reaching layer l.
            const int b = ctx.backward_stage_at[l];
            if (ctx.training && b >= 0) {
                ctx.stage_inputs[b][m] =
                    l == stage.first_layer ? on_host(lane, in, y, job) : lane.download(y, job);
                ctx.state->stage_input_stored(static_cast<size_t>(b), m);
            }
            y = run_layer(ctx, w, stage, l, y, extras, Phase::Forward);
        }
        lane.compute_end(job);
        if (last)
            ctx.outputs[m] = to_output_device(ctx, lane, y, job);
        else
            ctx.state->put(job, m, hand_off(ctx, job, lane, y));
    }
}

// The tail and backward jobs install `final` before their last microbatch (see FinalGradients).
void run_tail(CallContext &ctx, size_t job, size_t s, DeviceLane &lane, const StageWeights &w,
              std::optional<FinalGradients> &final) {
    const Stage &stage = ctx.stages[s];
    at::AutoGradMode grad_mode(true);
    for (size_t m = 0; m < ctx.num_microbatches(); ++m) {
        if (m + 1 == ctx.num_microbatches())
            final.emplace(ctx, w.leaves, lane, job);
        Activation x = to_device(lane, stage_input(ctx, job, s, m), job, ctx.store.model_dtype());
        maybe_require_grad(x, s > 0);
        MicrobatchExtras extras = extras_for(ctx, m, lane, job, true);
        lane.compute_begin(job);
        Activation y = run_stage(ctx, w, stage, x, extras, Phase::Tail);
        if (ctx.keep_outputs)
            ctx.outputs[m] = to_output_device(ctx, lane, detached(y), job);
        LossSite site{lane.device(), static_cast<int>(m)};
        ctx.losses[m] = loss_backward(*ctx.loss, y, extras.labels, site);
        lane.compute_end(job);
        send_row_gradients(ctx, w.leaves, lane, job, m);
        ctx.state->put(job, m, hand_off(ctx, job, lane, grads_of(x)));
    }
}

void run_backward(CallContext &ctx, size_t job, size_t s, DeviceLane &lane, const StageWeights &w,
                  std::optional<FinalGradients> &final) {
    const Stage &stage = ctx.backward_stages[s];
    at::AutoGradMode grad_mode(true);
    for (size_t m = 0; m < ctx.num_microbatches(); ++m) {
        if (m + 1 == ctx.num_microbatches())
            final.emplace(ctx, w.leaves, lane, job);
        ctx.state->wait_stage_input(s, m);
        Activation x = to_device(lane, ctx.stage_inputs[s][m], job, ctx.store.model_dtype());
        ctx.stage_inputs[s][m] = Transfer(); // recompute input no longer needed: free it
        MicrobatchExtras extras = extras_for(ctx, m, lane, job, false);
        // The first stage's inputs need a gradient only when the caller asked for it.
        const bool first = stage.first_layer == 0;
        const bool into_inputs = !first || ctx.want_input_grads;
        // The recompute needs the stage's input, not the microbatch's gradient: it runs before
        // the gradient is taken, so a device waiting for the stage above (the last microbatch,
        // when the pipeline drains) spends the wait recomputing, and only the backward proper
        // follows the gradient's arrival.
        lane.compute_begin(job);
        Activation y;                         // stage grain: the recomputed output
        std::vector<Activation> layer_inputs; // layer grain: each layer's input
        if (ctx.grain == RecomputeGrain::Stage) {
            maybe_require_grad(x, into_inputs);
            y = run_stage(ctx, w, stage, x, extras, Phase::Recompute);
        } else {
            // Layer grain: a gradient-free pass keeps only each layer's input, then each layer is
            // recomputed and back-propagated alone, so one layer's activations live at a time.
            at::NoGradGuard no_grad;
            Activation h = x;
            for (size_t l = stage.first_layer; l < stage.end_layer; ++l) {
                layer_inputs.push_back(h);
                if (l + 1 < stage.end_layer)
                    h = run_layer(ctx, w, stage, l, h, extras, Phase::Recompute);
            }
        }
        lane.compute_end_ahead(job);
        // The first backward job of a BackwardOnly call starts from the caller's gradients.
        Transfer incoming = ctx.kind == CallKind::BackwardOnly && job == 0
                                ? std::move(ctx.output_grads[m])
                                : ctx.state->take(job - 1, m);
        Activation g = to_device(lane, incoming, job, ctx.store.model_dtype());
        lane.compute_begin(job);
        if (ctx.grain == RecomputeGrain::Stage) {
            check_recompute_matches(y, g, layers_of(ctx, stage.first_layer, stage.end_layer));
            backward_if_needed(y, g);
            y.clear();
            g = grads_of(x);
        } else {
            for (size_t l = stage.end_layer; l-- > stage.first_layer;) {
                Activation xi = detached(layer_inputs[l - stage.first_layer]);
                layer_inputs[l - stage.first_layer].clear();
                maybe_require_grad(xi, l > stage.first_layer || into_inputs);
                Activation y = run_layer(ctx, w, stage, l, xi, extras, Phase::Recompute);
                check_recompute_matches(y, g, layers_of(ctx, l, l + 1));
                backward_if_needed(y, g);
                g = grads_of(xi);
            }
        }
        lane.compute_end(job);
        send_row_gradients(ctx, w.leaves, lane, job, m);
        if (first && ctx.want_input_grads)
            ctx.input_grads[m] = lane.download(g, job).tensors;
        else
            ctx.state->put(job, m, hand_off(ctx, job, lane, g));
    }
}

} // namespace

std::vector<size_t> stage_params(const CallContext &ctx, const Stage &stage) {
    std::vector<size_t> params;
    for (size_t l = stage.first_layer; l < stage.end_layer; ++l)
        for (size_t pi : ctx.store.layer_params(l))
            params.push_back(pi);
    return params;
}

CallContext::CallContext(const std::vector<std::unique_ptr<Layer>> &layers_,
                         const std::vector<Stage> &stages_,
                         const std::vector<Stage> &backward_stages_, const ParamStore &store_,
                         const Microbatches &microbatches_)
    : layers(layers_), stages(stages_), backward_stages(backward_stages_),
      backward_stage_at(layers_.size(), -1), store(store_), microbatches(microbatches_) {
    for (size_t b = 0; b < backward_stages.size(); ++b)
        backward_stage_at[backward_stages[b].first_layer] = static_cast<int>(b);
}

const Stage &job_stage(const CallContext &ctx, JobKind kind, size_t s) {
    return kind == JobKind::Backward ? ctx.backward_stages[s] : ctx.stages[s];
}

std::vector<CallJob> call_jobs(const CallContext &ctx) {
    const size_t S = ctx.stages.size(), B = ctx.backward_stages.size();
    std::vector<CallJob> jobs;
    if (ctx.kind == CallKind::BackwardOnly) {
        for (size_t b = B; b-- > 0;)
            jobs.push_back({JobKind::Backward, b});
        return jobs;
    }
    const bool fused = ctx.kind == CallKind::Fused;
    for (size_t s = 0; s < S; ++s)
        jobs.push_back({fused && s + 1 == S ? JobKind::Tail : JobKind::Forward, s});
    if (fused)
        for (size_t b = B - 1; b-- > 0;)
            jobs.push_back({JobKind::Backward, b});
    return jobs;
}

bool stage_weights_ready(const CallContext &ctx, const Stage &stage) {
    return !ctx.gate || ctx.gate->is_open(stage_params(ctx, stage), ctx.gate_step);
}

Transfer upload_stage_weights(const CallContext &ctx, const Stage &stage, DeviceLane &lane,
                              size_t job) {
    const std::vector<size_t> params = stage_params(ctx, stage);
    if (ctx.gate)
        ctx.gate->wait(params, ctx.gate_step);
    std::vector<at::Tensor> host;
    for (size_t pi : params)
        host.push_back(ctx.store.at(pi).live);
    return lane.upload_weights(host, job);
}

void run_stage_job(CallContext &ctx, JobKind kind, size_t job, size_t s, DeviceLane &lane,
                   const Transfer &weights) {
    StageWeights w = make_leaves(ctx, job_stage(ctx, kind, s), weights, kind != JobKind::Forward);
    w.lane = &lane;
    if (w.layer_landed.empty())
        lane.use(weights);
    std::optional<FinalGradients> final;
    switch (kind) {
    case JobKind::Forward:
        run_forward(ctx, job, s, lane, w);
        write_back_buffers(ctx, w, lane, job);
        return;
    case JobKind::Tail:
        run_tail(ctx, job, s, lane, w, final);
        write_back_buffers(ctx, w, lane, job);
        break;
    case JobKind::Backward:
        run_backward(ctx, job, s, lane, w, final);
        break;
    }
    final->finish(); // installed before the last microbatch of every tail and backward job
    std::vector<size_t> trained;
    for (const auto &leaf : w.leaves)
        trained.push_back(leaf.first);
    ctx.gradients->job_done(trained);
}

uint64_t job_layout_fingerprint(const CallContext &ctx, size_t num_devices) {
    uint64_t h = 1469598103934665603ull; // FNV-1a
    auto mix = [&](uint64_t v) {
        h ^= v;
        h *= 1099511628211ull;
    };
    mix(static_cast<uint64_t>(ctx.kind));
    mix(num_devices);
    for (const std::vector<Stage> *list : {&ctx.stages, &ctx.backward_stages}) {
        mix(list->size());
        for (const Stage &s : *list) {
            mix(s.first_layer);
            mix(s.end_layer);
        }
    }
    return h;
}

std::vector<int> gradient_jobs_per_param(const CallContext &ctx) {
    std::vector<int> jobs(ctx.store.size(), 0);
    for (const CallJob &job : call_jobs(ctx)) {
        if (job.kind == JobKind::Forward) // makes no leaves (make_leaves)
            continue;
        std::vector<bool> in_job(ctx.store.size(), false); // a shared parameter counts once
        for (size_t pi : stage_params(ctx, job_stage(ctx, job.kind, job.stage)))
            if (ctx.store.at(pi).trainable() && !in_job[pi]) {
                in_job[pi] = true;
                ++jobs[pi];
            }
    }
    return jobs;
}

void check_shapes(const std::vector<std::unique_ptr<Layer>> &layers, const ParamStore &store,
                  const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                  const Loss *loss) {
    // Runs the real layers on the host weights with an empty batch: every shape and dtype rule
    // of every op is checked at almost no cost, and no kernel lacks an implementation for it.
    at::NoGradGuard no_grad;
    // Host weights, so host tensors: an empty slice of a GPU input costs nothing to move.
    auto empty_batch = [](const at::Tensor &t) {
        return (t.dim() > 0 ? t.narrow(0, 0, 0) : t).to(at::kCPU);
    };
    const at::Tensor &in = inputs[0];
    at::Tensor x = empty_batch(in);
    if (at::isFloatingType(x.scalar_type()))
        x = x.to(store.model_dtype());
    std::vector<at::Tensor> side;
    for (size_t i = 1; i < inputs.size(); ++i)
        side.push_back(empty_batch(inputs[i]));
    LayerContext lc; // evaluation mode: shapes do not depend on dropout
    lc.side_inputs = &side;
    for (size_t l = 0; l < layers.size(); ++l) {
        // A caller-defined layer's code is not ours to run on an empty batch: the check stops
        // there, and its own errors surface during the call.
        if (!layers[l]->shape_checkable())
            return;
        std::vector<at::Tensor> params;
        for (size_t pi : store.layer_params(l))
            params.push_back(store.at(pi).live);
        try {
            x = layers[l]->forward(params, x, lc); // x stays the layer's input if it throws
        } catch (const c10::Error &e) {
            // Said with the microbatch's rows (every layer keeps dim 0 as the batch), not the
            // emptied batch the check ran on, which the op's own message still shows as 0.
            std::vector<int64_t> shape = x.sizes().vec();
            if (!shape.empty() && in.dim() > 0)
                shape[0] = in.size(0);
            const std::string layer = "layer " + std::to_string(l) + " (" + layers[l]->type() + ")";
            fail(ErrorKind::InvalidArgument,
                 layer + " cannot take an input of shape " + c10::str(at::IntArrayRef(shape)) +
                     " and dtype " + c10::toString(x.scalar_type()) +
                     " (a microbatch; checked on an empty batch before anything ran): " +
                     e.what_without_backtrace());
        }
    }
    if (!loss)
        return;
    // Emptying the batch hides a row-count mismatch; every layer keeps dim 0 as the batch, so
    // built-in losses need exactly one label row per input row.
    bool rowwise = loss->kind == LossKind::Mse || loss->kind == LossKind::CrossEntropy;
    if (rowwise && labels.defined() && labels.dim() > 0 && in.dim() > 0 &&
        labels.size(0) != in.size(0)) {
        const std::string rows = "labels have " + std::to_string(labels.size(0)) +
                                 " rows in this microbatch but input 0 has " +
                                 std::to_string(in.size(0));
        fail(ErrorKind::InvalidArgument, rows + "; the label batch must match the input batch");
    }
    if (loss->kind == LossKind::Mse && labels.defined() && in.dim() > 0 && x.dim() > 0) {
        // Say the shapes with the real batch size, not the emptied one.
        std::vector<int64_t> out_shape = x.sizes().vec();
        out_shape[0] = in.size(0);
        require(labels.sizes() == at::IntArrayRef(out_shape),
                "labels of shape " + c10::str(labels.sizes()) +
                    " do not match the model output of shape " + c10::str(out_shape) +
                    " (per microbatch)");
    }
    check_loss_inputs(*loss, x, labels.defined() ? empty_batch(labels) : labels);
}

} // namespace rp
