#include "engine/stage_executor.h"

#include "base/error.h"
#include "engine/seed.h"

namespace rp {
namespace {

// A stage's weights on the device, as autograd leaves when gradients are wanted.
struct StageWeights {
    std::vector<std::vector<at::Tensor>> per_layer;
    std::vector<std::pair<size_t, at::Tensor>> leaves; // (param index, tensor)
};

StageWeights make_leaves(const CallContext &ctx, const Stage &stage, const Transfer &uploaded,
                         bool requires_grad) {
    StageWeights w;
    size_t next = 0;
    for (size_t l = stage.first_layer; l < stage.end_layer; ++l) {
        std::vector<at::Tensor> params;
        for (size_t pi : ctx.store.layer_params(l)) {
            // detach(): a fresh tensor object even when no copy happened (CPU devices), so
            // autograd flags never touch the store's tensors.
            at::Tensor t = uploaded.tensors[next++].detach();
            if (requires_grad)
                t.requires_grad_(true);
            params.push_back(t);
            w.leaves.emplace_back(pi, t);
        }
        w.per_layer.push_back(std::move(params));
    }
    return w;
}

// Gradients leave the device once per stage and call, in the model dtype (half the bytes for
// bf16); the accumulator widens them to fp32 on the host as they land.
void download_grads(CallContext &ctx, const StageWeights &w, DeviceLane &lane, size_t job) {
    std::vector<size_t> index;
    std::vector<at::Tensor> grads;
    for (const auto &leaf : w.leaves)
        if (leaf.second.grad().defined()) {
            index.push_back(leaf.first);
            grads.push_back(leaf.second.grad());
        }
    // One number on the device says whether any element is inf or nan: the sum in float64
    // propagates both and cannot overflow, and the host is spared a second pass over the bytes.
    at::Tensor check;
    if (!grads.empty()) {
        std::vector<at::Tensor> sums;
        for (const at::Tensor &g : grads)
            sums.push_back(g.sum(at::kDouble));
        check = at::stack(sums).sum();
        grads.push_back(check);
    }
    Transfer host = lane.download(grads, job, Payload::Gradients);
    std::vector<std::pair<size_t, at::Tensor>> out;
    for (size_t i = 0; i < index.size(); ++i)
        out.emplace_back(index[i], host.tensors[i]);
    at::Tensor host_check = check.defined() ? host.tensors.back() : at::Tensor();
    ctx.gradients->add(std::move(out), std::move(host_check), std::move(host), lane);
}

// A host tensor (ready after `ready`) on the device, in the compute dtype, as a fresh leaf.
at::Tensor to_device(DeviceLane &lane, const Transfer &host, size_t job, at::ScalarType dtype) {
    Transfer d = lane.upload(host, job);
    lane.use(d);
    at::Tensor x = d.tensors[0];
    if (!x.defined())
        return x;
    at::ScalarType target = at::isFloatingType(x.scalar_type()) ? dtype : x.scalar_type();
    return x.to(target).detach();
}

// What travels with microbatch m besides the activation, on the job's device.
struct MicrobatchExtras {
    size_t microbatch = 0;
    std::vector<at::Tensor> side_inputs;
    at::Tensor labels; // tail stage of a training call only
};

MicrobatchExtras extras_for(const CallContext &ctx, size_t m, DeviceLane &lane, size_t job,
                            bool tail) {
    MicrobatchExtras e;
    e.microbatch = m;
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

LayerContext layer_context(const CallContext &ctx, size_t layer, const MicrobatchExtras &e) {
    LayerContext lc;
    lc.training = ctx.training;
    lc.dropout_seed = dropout_seed(ctx.seed, ctx.call_index, layer, e.microbatch);
    lc.side_inputs = &e.side_inputs;
    // Labels reach the layers only for the losses a last layer may fuse (the causal-LM head);
    // with any other loss the model must hand its plain output to that loss.
    const bool fusable = ctx.loss && (ctx.loss->kind == LossKind::CausalLm ||
                                      ctx.loss->kind == LossKind::Output);
    lc.labels = fusable && e.labels.defined() ? &e.labels : nullptr;
    return lc;
}

at::Tensor run_layer(const CallContext &ctx, const StageWeights &w, const Stage &stage, size_t l,
                     const at::Tensor &x, const MicrobatchExtras &e) {
    return ctx.layers[l]->forward(w.per_layer[l - stage.first_layer], x, layer_context(ctx, l, e));
}

at::Tensor run_stage(const CallContext &ctx, const StageWeights &w, const Stage &stage,
                     at::Tensor x, const MicrobatchExtras &e) {
    for (size_t l = stage.first_layer; l < stage.end_layer; ++l)
        x = run_layer(ctx, w, stage, l, x, e);
    return x;
}

// Input of stage `stage` for microbatch m: the call's input for the first stage, else the
// previous job's result.
Transfer stage_input(CallContext &ctx, size_t job, size_t stage, size_t m) {
    if (stage == 0)
        return {{ctx.microbatches.inputs[m][0]}, nullptr};
    return ctx.state->take(job - 1, m);
}

void maybe_require_grad(at::Tensor &x, bool wanted) {
    if (wanted && x.defined() && at::isFloatingType(x.scalar_type()))
        x.requires_grad_(true);
}

at::Tensor grad_of(const at::Tensor &x) { return x.requires_grad() ? x.grad() : at::Tensor(); }

void backward_if_needed(const at::Tensor &y, const at::Tensor &grad) {
    if (y.requires_grad() && grad.defined())
        torch::autograd::backward({y}, {grad});
}

at::Tensor to_output_device(const CallContext &ctx, DeviceLane &lane, const at::Tensor &y,
                            size_t job) {
    if (ctx.output_device.is_cpu())
        return lane.download({y}, job).tensors[0];
    return y.to(ctx.output_device, /*non_blocking=*/true);
}

void run_forward(CallContext &ctx, size_t job, size_t s, DeviceLane &lane, const StageWeights &w) {
    const Stage &stage = ctx.stages[s];
    const bool last = s + 1 == ctx.stages.size();
    at::NoGradGuard no_grad;
    for (size_t m = 0; m < ctx.num_microbatches(); ++m) {
        Transfer in = stage_input(ctx, job, s, m);
        if (ctx.training)
            ctx.stage_inputs[s][m] = in;
        at::Tensor x = to_device(lane, in, job, ctx.store.model_dtype());
        MicrobatchExtras extras = extras_for(ctx, m, lane, job, false);
        lane.compute_begin(job);
        at::Tensor y = run_stage(ctx, w, stage, x, extras);
        lane.compute_end(job);
        if (last)
            ctx.outputs[m] = to_output_device(ctx, lane, y, job);
        else
            ctx.state->put(job, m, lane.download({y}, job));
    }
}

void run_tail(CallContext &ctx, size_t job, size_t s, DeviceLane &lane, const StageWeights &w) {
    const Stage &stage = ctx.stages[s];
    at::AutoGradMode grad_mode(true);
    for (size_t m = 0; m < ctx.num_microbatches(); ++m) {
        at::Tensor x = to_device(lane, stage_input(ctx, job, s, m), job, ctx.store.model_dtype());
        maybe_require_grad(x, s > 0);
        MicrobatchExtras extras = extras_for(ctx, m, lane, job, true);
        lane.compute_begin(job);
        at::Tensor y = run_stage(ctx, w, stage, x, extras);
        if (ctx.keep_outputs)
            ctx.outputs[m] = to_output_device(ctx, lane, y.detach(), job);
        ctx.losses[m] = loss_backward(*ctx.loss, y, extras.labels, static_cast<int>(m));
        lane.compute_end(job);
        ctx.state->put(job, m, lane.download({grad_of(x)}, job));
    }
}

void run_backward(CallContext &ctx, size_t job, size_t s, DeviceLane &lane, const StageWeights &w) {
    const Stage &stage = ctx.stages[s];
    at::AutoGradMode grad_mode(true);
    for (size_t m = 0; m < ctx.num_microbatches(); ++m) {
        at::Tensor g = to_device(lane, ctx.state->take(job - 1, m), job, ctx.store.model_dtype());
        at::Tensor x = to_device(lane, ctx.stage_inputs[s][m], job, ctx.store.model_dtype());
        ctx.stage_inputs[s][m] = Transfer(); // recompute input no longer needed: free it
        MicrobatchExtras extras = extras_for(ctx, m, lane, job, false);
        lane.compute_begin(job);
        if (ctx.grain == RecomputeGrain::Stage) {
            maybe_require_grad(x, s > 0);
            at::Tensor y = run_stage(ctx, w, stage, x, extras);
            backward_if_needed(y, g);
            g = grad_of(x);
        } else {
            // Layer grain: a gradient-free pass keeps only each layer's input, then each layer is
            // recomputed and back-propagated alone, so one layer's activations live at a time.
            std::vector<at::Tensor> layer_inputs;
            {
                at::NoGradGuard no_grad;
                at::Tensor h = x;
                for (size_t l = stage.first_layer; l < stage.end_layer; ++l) {
                    layer_inputs.push_back(h);
                    if (l + 1 < stage.end_layer)
                        h = run_layer(ctx, w, stage, l, h, extras);
                }
            }
            for (size_t l = stage.end_layer; l-- > stage.first_layer;) {
                at::Tensor xi = layer_inputs[l - stage.first_layer].detach();
                layer_inputs[l - stage.first_layer] = at::Tensor();
                maybe_require_grad(xi, l > stage.first_layer || s > 0);
                at::Tensor y = run_layer(ctx, w, stage, l, xi, extras);
                backward_if_needed(y, g);
                g = grad_of(xi);
            }
        }
        lane.compute_end(job);
        ctx.state->put(job, m, lane.download({g}, job));
    }
}

} // namespace

namespace {

std::vector<size_t> stage_params(const CallContext &ctx, size_t s) {
    std::vector<size_t> params;
    for (size_t l = ctx.stages[s].first_layer; l < ctx.stages[s].end_layer; ++l)
        for (size_t pi : ctx.store.layer_params(l))
            params.push_back(pi);
    return params;
}

} // namespace

bool stage_weights_ready(const CallContext &ctx, size_t s) {
    return !ctx.gate || ctx.gate->is_open(stage_params(ctx, s), ctx.gate_step);
}

Transfer upload_stage_weights(const CallContext &ctx, size_t s, DeviceLane &lane, size_t job) {
    const std::vector<size_t> params = stage_params(ctx, s);
    if (ctx.gate)
        ctx.gate->wait(params, ctx.gate_step);
    std::vector<at::Tensor> host;
    for (size_t pi : params)
        host.push_back(ctx.store.at(pi).live);
    return lane.upload_weights(host, job);
}

void run_stage_job(CallContext &ctx, JobKind kind, size_t job, size_t s, DeviceLane &lane,
                   const Transfer &weights) {
    lane.use(weights);
    StageWeights w = make_leaves(ctx, ctx.stages[s], weights, kind != JobKind::Forward);
    switch (kind) {
    case JobKind::Forward:
        run_forward(ctx, job, s, lane, w);
        return;
    case JobKind::Tail:
        run_tail(ctx, job, s, lane, w);
        break;
    case JobKind::Backward:
        run_backward(ctx, job, s, lane, w);
        break;
    }
    download_grads(ctx, w, lane, job);
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
        std::vector<at::Tensor> params;
        for (size_t pi : store.layer_params(l))
            params.push_back(store.at(pi).live);
        const at::IntArrayRef before = x.sizes();
        std::string shape = c10::str(before);
        std::string dtype = c10::toString(x.scalar_type());
        try {
            x = layers[l]->forward(params, x, lc);
        } catch (const c10::Error &e) {
            fail(ErrorKind::InvalidArgument,
                 "layer " + std::to_string(l) + " (" + layers[l]->type() +
                     ") cannot take an input of shape " + shape + " (batch dimension emptied) "
                     "and dtype " + dtype + ": " + e.what_without_backtrace());
        }
    }
    if (!loss)
        return;
    // Emptying the batch hides a row-count mismatch; every layer keeps dim 0 as the batch, so
    // built-in losses need exactly one label row per input row.
    bool rowwise = loss->kind == LossKind::Mse || loss->kind == LossKind::CrossEntropy;
    if (rowwise && labels.defined() && labels.dim() > 0 && in.dim() > 0)
        require(labels.size(0) == in.size(0),
                "labels have " + std::to_string(labels.size(0)) + " rows in this microbatch but "
                "input 0 has " + std::to_string(in.size(0)) +
                    "; the label batch must match the input batch");
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
