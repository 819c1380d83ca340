// The Model's non-fused training (upstream's forward() then loss.backward()): a training forward
// that keeps what its backward needs, and the backward from the caller's output gradients, with
// the input gradients put back together as the inputs were split.
#include "engine/model.h"

#include <string>

#include "base/error.h"

namespace rp {

namespace {

// The caller's memory is borrowed for one call; a forward whose backward comes later keeps its
// own copy of the microbatch inputs (the first stage's recompute and the side inputs read them).
Microbatches owned_copy(const Microbatches &mb) {
    Microbatches out;
    for (const auto &inputs : mb.inputs) {
        std::vector<at::Tensor> copies;
        for (const at::Tensor &t : inputs)
            copies.push_back(t.clone());
        out.inputs.push_back(std::move(copies));
    }
    out.labels.assign(out.inputs.size(), at::Tensor());
    return out;
}

} // namespace

std::vector<at::Tensor> Model::forward_train(const std::vector<at::Tensor> &inputs,
                                             const RunConfig &call) {
    share_initial_weights();
    const ResolvedRunConfig cfg = resolve_run_config(call);
    Microbatches mb = begin_forward_call(inputs, cfg);
    pending_.reset(); // a new forward replaces one whose backward never came
    auto pending = std::make_unique<PendingBackward>();
    pending->microbatches = owned_copy(mb);
    pending->call_index = training_calls_++;
    pending->grain = cfg.grain;
    pending->merged = cfg.merge_output;
    pending->step = enqueued_;
    pending->stages = plan_call(tokens_per_microbatch(mb), cfg.grain, StageUse::Split);
    pending->backward_stages = backward_plan_for(pending->stages);
    pending->custom_split = static_cast<bool>(cfg.split);
    for (size_t i = 0; i < inputs.size(); ++i) {
        auto it = cfg.input_split_dims.find(static_cast<int>(i));
        const int dim = it == cfg.input_split_dims.end() ? 0 : it->second;
        pending->input_split_dims.push_back(inputs[i].dim() == 0 ? kReplicate : dim);
        pending->input_dtypes.push_back(inputs[i].scalar_type());
    }
    CallContext ctx{layers_, pending->stages, pending->backward_stages, store_,
                    pending->microbatches};
    ctx.seed = seed_;
    ctx.call_index = pending->call_index;
    ctx.training = true;
    ctx.kind = CallKind::ForwardKeep;
    ctx.output_device = cfg.output_device;
    ctx.grain = cfg.grain;
    gate_call(ctx);
    pipeline_.run(ctx);
    pending->stage_inputs = std::move(ctx.stage_inputs);
    for (const auto &outs : ctx.outputs) {
        std::vector<std::vector<int64_t>> shapes;
        for (const at::Tensor &t : outs)
            shapes.push_back(t.sizes().vec());
        pending->output_shapes.push_back(std::move(shapes));
    }
    pending_ = std::move(pending);
    return finish_outputs(std::move(ctx.outputs), cfg.merge_output, inputs);
}

// The caller's gradients, as forward_train returned the outputs (merged: one per output; else
// microbatch-major), split back into each microbatch's gradients.
std::vector<Transfer> Model::split_output_grads(const PendingBackward &p,
                                                const std::vector<at::Tensor> &grads) const {
    const size_t M = p.output_shapes.size();
    const size_t K = M ? p.output_shapes.front().size() : 0;
    std::vector<Transfer> per_mb(M);
    auto check = [&](const at::Tensor &g, const std::vector<int64_t> &shape, const std::string &what) {
        require(at::isFloatingType(g.scalar_type()), what + " is not floating point");
        require(g.sizes() == at::IntArrayRef(shape), what + " has shape " + c10::str(g.sizes()) +
                                                         ", the output " +
                                                         c10::str(at::IntArrayRef(shape)));
    };
    if (!p.merged) {
        require(grads.size() == M * K, "rp_backward needs " + std::to_string(M * K) +
                                           " gradients (one per output of each microbatch, as "
                                           "the forward returned them), got " +
                                           std::to_string(grads.size()));
        for (size_t m = 0; m < M; ++m)
            for (size_t k = 0; k < K; ++k) {
                const at::Tensor &g = grads[m * K + k];
                if (g.defined())
                    check(g, p.output_shapes[m][k], "gradient " + std::to_string(m * K + k));
                per_mb[m].tensors.push_back(g);
            }
        return per_mb;
    }
    require(grads.size() == K, "rp_backward needs " + std::to_string(K) +
                                   " gradients (one per merged output), got " +
                                   std::to_string(grads.size()));
    for (size_t k = 0; k < K; ++k) {
        const at::Tensor &g = grads[k];
        const std::vector<int64_t> &first = p.output_shapes.front()[k];
        if (!g.defined()) {
            for (size_t m = 0; m < M; ++m)
                per_mb[m].tensors.push_back(g);
            continue;
        }
        if (first.empty()) { // 0-d outputs were averaged over the microbatches
            check(g, first, "gradient " + std::to_string(k));
            for (size_t m = 0; m < M; ++m)
                per_mb[m].tensors.push_back(g / static_cast<double>(M));
            continue;
        }
        std::vector<int64_t> merged = first;
        merged[0] = 0;
        std::vector<int64_t> rows;
        for (size_t m = 0; m < M; ++m) {
            rows.push_back(p.output_shapes[m][k][0]);
            merged[0] += rows.back();
        }
        check(g, merged, "gradient " + std::to_string(k));
        std::vector<at::Tensor> pieces = g.split_with_sizes(rows, 0);
        for (size_t m = 0; m < M; ++m)
            per_mb[m].tensors.push_back(pieces[m].contiguous());
    }
    return per_mb;
}

// The first stage's per-microbatch input gradients put back together as the inputs were split:
// concatenated along the split dim, or summed where every microbatch got the whole input.
std::vector<at::Tensor> Model::merge_input_grads(const PendingBackward &p,
                                                 std::vector<std::vector<at::Tensor>> per_mb,
                                                 double unscale) const {
    const size_t n = p.input_dtypes.size();
    const size_t fed = layers_.front()->takes_all_call_inputs() ? n : std::min<size_t>(n, 1);
    std::vector<at::Tensor> merged(n);
    for (size_t i = 0; i < fed; ++i) {
        if (!at::isFloatingType(p.input_dtypes[i]))
            continue;
        std::vector<at::Tensor> pieces;
        bool any = false;
        for (size_t m = 0; m < per_mb.size(); ++m) {
            at::Tensor g = i < per_mb[m].size() ? per_mb[m][i] : at::Tensor();
            any = any || g.defined();
            // No gradient reached this piece (a layer ignored it): zeros, as autograd's sum.
            pieces.push_back(g.defined() ? g.to(at::kFloat)
                                         : at::zeros(p.microbatches.inputs[m][i].sizes(),
                                                     at::TensorOptions().dtype(at::kFloat)));
        }
        if (!any)
            continue;
        const int dim = p.input_split_dims[i];
        at::Tensor g = dim == kReplicate ? at::stack(pieces).sum(0) : at::cat(pieces, dim);
        if (unscale != 1.0)
            g = g * unscale;
        merged[i] = g.to(p.input_dtypes[i]).contiguous();
    }
    return merged;
}

void Model::backward(const std::vector<at::Tensor> &output_grads,
                     std::vector<at::Tensor> *input_grads) {
    if (!pending_)
        fail(ErrorKind::State, "no forward to back-propagate: run the training forward first "
                               "(each one can be back-propagated once)");
    if (pending_->step != enqueued_)
        fail(ErrorKind::State, "an optimizer step ran since the training forward: its weights "
                               "are gone; run the forward again");
    require(!input_grads || !pending_->custom_split,
            "input gradients need the built-in microbatch split: the training forward cut its "
            "inputs with a split callback, whose pieces cannot be put back together (use "
            "input_split_dims, or rp_backward)");
    std::vector<Transfer> grads = split_output_grads(*pending_, output_grads);
    std::unique_ptr<PendingBackward> p = std::move(pending_); // consumed, also on failure
    timeline_.begin_call();
    const double scale = scaler_.enabled() ? scaler_.scale() : 1.0;
    for (Transfer &t : grads)
        for (at::Tensor &g : t.tensors)
            if (g.defined() && scale != 1.0)
                g = g * scale;
    stages_ = p->stages;
    CallContext ctx{layers_, p->stages, p->backward_stages, store_, p->microbatches};
    ctx.seed = seed_;
    ctx.call_index = p->call_index;
    ctx.training = true;
    ctx.kind = CallKind::BackwardOnly;
    ctx.grain = p->grain;
    ctx.stage_inputs = std::move(p->stage_inputs);
    ctx.output_grads = std::move(grads);
    ctx.want_input_grads = input_grads != nullptr;
    if (input_grads)
        ctx.input_grads.assign(p->microbatches.inputs.size(), {});
    std::vector<at::Tensor> merged;
    run_training_pipeline(ctx, scale, [&] {
        if (input_grads) // a failure here must also leave the gradients untouched
            merged = merge_input_grads(*p, std::move(ctx.input_grads), 1.0 / scale);
    });
    if (input_grads)
        *input_grads = std::move(merged);
}

} // namespace rp
