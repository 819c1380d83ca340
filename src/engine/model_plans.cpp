// The Model's stage plans: the footprints and workspaces the planner sizes stages by, the
// automatic plan per call shape and its one re-plan from measured times on GPUs, and the
// explicit forward and backward plans a caller sets.
#include "engine/model.h"

#include <algorithm>
#include <limits>
#include <string>

#include "base/error.h"
#include "base/log.h"
#include "engine/fused_schedule.h"
#include "engine/stage_planner.h"
#include "engine/stage_times.h"

namespace rp {

// A layer's weights and their gradients in the model dtype.
double Model::layer_param_bytes(size_t layer) const {
    double bytes = 0.0;
    for (size_t pi : store_.layer_params(layer))
        bytes += 2.0 * static_cast<double>(store_.at(pi).live.nbytes());
    return bytes;
}

void Model::grant_workspaces() {
    // A stage's weights, gradients and workspaces may use a third of the cap (make_plan). A
    // layer's workspace may take half of that, less the layer's own weights and gradients: the
    // layer then fits a stage, and the stage keeps room for other layers. (The LM head of
    // Qwen3-1.7B under a 10 GiB cap: 1.67 GiB, 1.16 of them its fp32 gradient accumulator, the
    // rest ~1,800 tokens of bf16 logits.) No cap: no limit.
    const double limit = plan_cap_ / 3.0;
    for (size_t l = 0; l < layers_.size(); ++l) {
        double grant = std::numeric_limits<double>::infinity();
        if (limit > 0)
            grant = std::max(0.0, std::min(limit / 2.0, limit - layer_param_bytes(l)));
        layers_[l]->grant_workspace(grant, store_.model_dtype());
    }
}

std::vector<Stage> Model::make_plan(int64_t tokens, RecomputeGrain grain, StageUse use) const {
    if (!explicit_plan_.empty())
        return plan_explicit(explicit_plan_, layers_.size());
    PlanRequest r;
    r.costs = layer_costs_;
    r.layers = footprints_;
    // Two stages per device keeps every device busy with the fused schedule while each stage
    // stays large enough to amortise its hand-offs. Memory-saving mode wants at least eight: a
    // stage goes up only once the step has updated all of it, so the smaller the first stages
    // the sooner the next call's forward can follow the optimizer through the model.
    const size_t min_stages = store_.saving() ? 8 : 2;
    r.min_stages = std::max<size_t>(min_stages, 2 * num_devices());
    // A GPU holds two stages' weights (one computing, one arriving) and one stage's gradients:
    // a stage's fixed bytes may use a third of the cap, which keeps them well within the half
    // that two resident stages allow. While a stage computes, its fixed bytes and activations
    // share the cap with the next stage's arriving weights (at most a sixth of it) and the
    // transfers in flight and allocator slack (a twelfth): a stage may use three quarters.
    r.max_stage_weight_bytes = plan_cap_ / 3.0;
    r.max_stage_bytes = plan_cap_ * 0.75;
    r.tokens = static_cast<double>(tokens);
    r.grain = grain;
    r.use = use;
    // Memory-saving mode on several GPUs: each device's first jobs of a call wait for the step's
    // update of their stages (one weight copy, StepGate). With in-call steps those updates are
    // the backlog at the calls' boundary (each device's first stage is its last backward job, its
    // second stage the one before, so their gradients are final last); an explicit step updates
    // the stages in order, so the next call waits for those first. Light leading stages shorten
    // that wait: Qwen3-8B on two H200s, in-call steps, 2.8-3.8% more tokens/s than the balanced
    // plan in the same lease (bench/RESULTS.md, round 27), and lighter second stages 5% more
    // (round 29). On one GPU the optimizer has no slack in the backward, and
    // small leading stages only moved the wait to later stages (round 25), so one GPU keeps the
    // balanced plan.
    if (store_.saving() && num_devices() > 1 && use != StageUse::Inference)
        r.light_leading_stages = num_devices();
    // Several GPUs once times are measured (standard mode; memory-saving mode's stages also
    // pace the optimizer, which the model of the call leaves out): the plan whose call is
    // modelled shortest.
    const bool model_the_call = num_devices() > 1 && use == StageUse::Fused &&
                                !store_.saving() && !layer_forward_ms_.empty();
    std::vector<Stage> stages =
        model_the_call ? plan_for_devices(r, layer_forward_ms_, layer_backward_ms_,
                                          num_devices(), measured_microbatches_)
                       : plan_balanced(r);
    if (plan_cap_ > 0 && tokens > 0) {
        double worst = 0;
        size_t worst_stage = 0;
        for (size_t s = 0; s < stages.size(); ++s) {
            double b = stage_footprint(r, stages[s].first_layer, stages[s].end_layer);
            if (b > worst) {
                worst = b;
                worst_stage = s;
            }
        }
        if (worst > r.max_stage_bytes)
            log(LogLevel::Warn,
                name_ + ": at " + std::to_string(tokens) + " tokens per microbatch, stage " +
                    std::to_string(worst_stage) + " (layer " +
                    std::to_string(stages[worst_stage].first_layer) + ") is estimated to need " +
                    std::to_string(worst / 1073741824.0) + " GiB, more than the " +
                    std::to_string(r.max_stage_bytes / 1073741824.0) +
                    " GiB a stage may use under the GPU memory cap; use more microbatches "
                    "(fewer tokens each) or a higher cap");
    }
    return stages;
}

int64_t Model::tokens_per_microbatch(const Microbatches &mb) {
    int64_t most = 0;
    for (const auto &inputs : mb.inputs) {
        if (inputs.empty() || !inputs[0].defined())
            continue;
        const at::Tensor &x = inputs[0];
        int64_t tokens = x.numel();
        if (at::isFloatingType(x.scalar_type()) && x.dim() >= 2 && x.size(-1) > 0)
            tokens /= x.size(-1);
        most = std::max(most, tokens);
    }
    return most;
}

const std::vector<Stage> &Model::plan_call(int64_t tokens, RecomputeGrain grain, StageUse use) {
    // Without a cap (CPU devices) or with an explicit plan, activations change nothing: one plan.
    if (plan_cap_ <= 0 || !explicit_plan_.empty())
        tokens = 0;
    if (use == StageUse::Inference)
        grain = RecomputeGrain::Stage;
    PlanKey key{tokens, static_cast<int>(grain), static_cast<int>(use)};
    auto found = plans_.find(key);
    if (found == plans_.end()) {
        if (plans_.size() >= 64)
            plans_.clear(); // bounded: a loop over ever-new shapes re-plans, never grows
        found = plans_.emplace(key, make_plan(tokens, grain, use)).first;
        if (tokens > 0)
            log(LogLevel::Info, name_ + ": " + std::to_string(found->second.size()) +
                                    " stages for " + std::to_string(tokens) +
                                    " tokens per microbatch");
    }
    last_plan_key_ = key;
    stages_ = found->second;
    return stages_;
}

void Model::measure_for_replan() {
    // The first call's times are mostly one-time costs (library initialisation, kernel
    // autotuning, allocator growth) and fall on whichever stages ran first on each device: on
    // H200s they made Qwen3-1.7B's tail look 14x slower than it is (bench/RESULTS.md, round 6).
    // The second call still shares the host with the first optimizer step's one-time work: on
    // H100s it took 2 to 11 times the steady call, and the one-GPU plans it chose for the same
    // settings ranged from [13, 18] to [25, 6] layers, 8% apart in tokens/s (round 14). Each
    // stage takes its fastest time over the calls up to the re-plan's: slowed calls measure a
    // stage too long, never too short.
    if (calls_since_plan_ >= kReplanAfterCalls || !has_cuda_devices() || !explicit_plan_.empty())
        return;
    StageTimes now = stage_times_of(pipeline_.last_trace(), stages_, num_devices() > 1);
    replan_times_ = replan_times_ ? fastest(*replan_times_, now) : std::move(now);
    if (++calls_since_plan_ == kReplanAfterCalls)
        replan_from(*replan_times_);
}

void Model::replan_from(const StageTimes &measured) {
    // Spread each stage's measured compute time over its layers in proportion to their
    // estimates, then re-balance with the same memory limit: layers the estimate got wrong move.
    // One GPU runs the jobs of a call one after another: a stage weighs the sum of its jobs.
    // On several GPUs jobs of different stages overlap and the longest job paces the pipeline,
    // so a stage weighs its longest job: the tail's (forward and backward of its layers without
    // recompute) against a backward job's (recompute and backward). In a sum the tail's layers
    // look cheaper (no recompute, no forward job) and the tail would grow into the slowest job.
    // StageTimes::weight is that sum or that longest job.
    const bool several = num_devices() > 1;
    // Spread a per-stage time over the stage's layers in proportion to their estimates.
    const std::vector<Stage> &stages = measured.stages; // the last call's plan, stages_
    auto per_layer = [&](const std::vector<double> &per_stage) {
        std::vector<double> out(layers_.size(), -1.0);
        for (size_t s = 0; s < stages.size(); ++s) {
            if (per_stage[s] < 0)
                continue; // no such job for this stage
            double estimate = 0;
            for (size_t l = stages[s].first_layer; l < stages[s].end_layer; ++l)
                estimate += layers_[l]->cost_estimate();
            for (size_t l = stages[s].first_layer; l < stages[s].end_layer; ++l)
                out[l] = per_stage[s] * layers_[l]->cost_estimate() / estimate;
        }
        return out;
    };
    std::vector<double> cost = per_layer(measured.weight);
    if (dp_) // every rank must plan alike (GPU data parallelism pairs the ranks' jobs)
        dp_->average(cost);
    layer_costs_ = std::move(cost);
    if (several)
        measure_layer_times(per_layer(measured.forward), per_layer(measured.backward),
                            measured.microbatches);
    // The fused call as modelled for a plan (plan_for_devices), for the log: -1 if not modelled.
    auto modelled_ms = [&](const std::vector<Stage> &stages) {
        if (layer_forward_ms_.empty() || stages.empty())
            return -1.0;
        std::vector<size_t> cuts{0};
        for (const Stage &st : stages)
            cuts.push_back(st.end_layer);
        return fused_call_ms(fused_job_ms(cuts, layer_forward_ms_, layer_backward_ms_),
                             num_devices(), measured_microbatches_);
    };
    const double before_ms = modelled_ms(stages);
    plans_.clear();
    stages_ = make_plan(std::get<0>(last_plan_key_),
                        static_cast<RecomputeGrain>(std::get<1>(last_plan_key_)),
                        static_cast<StageUse>(std::get<2>(last_plan_key_)));
    plans_.emplace(last_plan_key_, stages_);
    std::string times, plan;
    for (double ms : measured.weight)
        times += (times.empty() ? "" : ", ") + std::to_string(static_cast<int>(ms));
    for (int c : stage_plan())
        plan += (plan.empty() ? "" : ", ") + std::to_string(c);
    std::string model;
    if (before_ms >= 0)
        model = " (the fused call modelled: " + std::to_string(static_cast<int>(before_ms)) +
                " ms before, " + std::to_string(static_cast<int>(modelled_ms(stages_))) +
                " ms now)";
    log(LogLevel::Info, name_ + ": re-planned from measured stage times [" + times +
                            "] ms: layers per stage [" + plan + "]" + model);
}

void Model::measure_layer_times(std::vector<double> forward, std::vector<double> backward,
                                size_t microbatches) {
    // A fused call measures every layer's backward time (a backward job or the tail) and the
    // forward time of every layer but the tail's: those get the others' forward share of it.
    double forward_sum = 0, backward_sum = 0;
    for (size_t l = 0; l < layers_.size(); ++l)
        if (forward[l] >= 0 && backward[l] >= 0) {
            forward_sum += forward[l];
            backward_sum += backward[l];
        }
    for (size_t l = 0; l < layers_.size(); ++l)
        if (backward[l] < 0 || microbatches == 0)
            return; // not a fused call's trace: nothing to model with
    const double share = backward_sum > 0 ? forward_sum / backward_sum : 1.0 / 3.0;
    for (size_t l = 0; l < layers_.size(); ++l)
        if (forward[l] < 0)
            forward[l] = share * backward[l];
    if (dp_) { // every rank must plan alike
        dp_->average(forward);
        dp_->average(backward);
    }
    layer_forward_ms_ = std::move(forward);
    layer_backward_ms_ = std::move(backward);
    measured_microbatches_ = microbatches;
}

std::vector<Stage> Model::backward_plan_for(const std::vector<Stage> &forward) const {
    if (explicit_backward_plan_.empty())
        return forward;
    return plan_explicit(explicit_backward_plan_, layers_.size());
}

std::vector<int> Model::backward_stage_plan() const {
    if (!explicit_backward_plan_.empty())
        return explicit_backward_plan_;
    return stage_plan();
}

void Model::set_backward_stage_plan(const std::vector<int> &layers_per_stage) {
    if (!layers_per_stage.empty()) {
        if (explicit_plan_.empty())
            fail(ErrorKind::State,
                 "a backward stage plan needs an explicit forward stage plan (the automatic "
                 "planner changes the stages with the call shape): set one first");
        plan_explicit(layers_per_stage, layers_.size()); // validates: throws before any change
    }
    if (pending_)
        fail(ErrorKind::State, "a training forward awaits its backward, whose kept stage "
                               "inputs follow the current plan: run rp_backward first");
    explicit_backward_plan_ = layers_per_stage;
}

std::vector<int> Model::plan_stages(double max_stage_bytes, size_t min_stages) const {
    PlanRequest r;
    r.costs = layer_costs_;
    r.layers = footprints_;
    r.min_stages = std::max<size_t>(1, std::min(min_stages, layers_.size()));
    r.max_stage_weight_bytes = max_stage_bytes;
    r.weight_limit_source = "the limit asked for; a plan needs at least that much a stage";
    std::vector<int> counts;
    for (const Stage &s : plan_balanced(r))
        counts.push_back(static_cast<int>(s.end_layer - s.first_layer));
    return counts;
}

std::vector<int> Model::stage_plan() const {
    std::vector<int> counts;
    for (const Stage &s : stages_)
        counts.push_back(static_cast<int>(s.end_layer - s.first_layer));
    return counts;
}

void Model::set_stage_plan(const std::vector<int> &layers_per_stage) {
    // make_plan reads explicit_plan_: swap it in, and back if the plan is refused.
    std::vector<int> previous = std::move(explicit_plan_);
    explicit_plan_ = layers_per_stage;
    std::vector<Stage> stages;
    try {
        stages = make_plan(0, RecomputeGrain::Stage, StageUse::Fused);
        if (pending_)
            fail(ErrorKind::State, "a training forward awaits its backward, whose kept stage "
                                   "inputs follow the current plan: run rp_backward first");
    } catch (...) {
        explicit_plan_ = std::move(previous);
        throw;
    }
    stages_ = std::move(stages);
    explicit_backward_plan_.clear(); // a backward plan is made for the forward plan it follows
    plans_.clear();                  // plans made per call shape under the old setting
    if (layers_per_stage.empty()) { // on GPUs the automatic plan is measured and re-planned again
        calls_since_plan_ = 0;
        replan_times_.reset();
    }
}

} // namespace rp
