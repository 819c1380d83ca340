// Cuts the layer list into contiguous stages.
#pragma once
#include <vector>

#include "engine/run_config.h"

namespace rp {

struct Stage {
    size_t first_layer; // inclusive
    size_t end_layer;   // exclusive
};

// What the planner knows of one layer's device memory.
struct LayerFootprint {
    // Weights and their gradients in the model dtype, plus the layer's own workspace.
    double fixed_bytes = 0;
    // Activations a forward with gradients keeps for backward, per token of the microbatch
    // (Layer::activation_bytes_per_token).
    double activation_bytes_per_token = 0;
};

// Which call the stages serve: it decides what a stage keeps of its activations.
enum class StageUse {
    Inference, // forward without gradients: one layer's intermediates at a time
    Fused,     // forward stages, the fused tail (no recompute), backward stages (recompute)
    Split,     // a training forward now, its backward later: every stage is recomputed
};

struct PlanRequest {
    std::vector<double> costs;          // per layer, estimated or measured
    std::vector<LayerFootprint> layers; // per layer
    size_t min_stages = 1;
    double max_stage_weight_bytes = 0; // fixed bytes of a stage; <= 0: no limit
    // Where that limit comes from and what to do about a layer over it, for the error message.
    const char *weight_limit_source = "a third of the GPU memory cap; raise the cap or split "
                                      "the layer";
    double max_stage_bytes = 0; // fixed bytes plus activations; <= 0: no limit
    double tokens = 0;          // tokens of the largest microbatch of the call
    RecomputeGrain grain = RecomputeGrain::Stage;
    StageUse use = StageUse::Fused;
    // The first `light_leading_stages` stages count their cost kLightStageWeight times and the
    // next `light_leading_stages` kSecondLightStageWeight times (stage_cost_weight), so that
    // plan_balanced keeps them at most that fraction of the largest other stage. Memory-saving
    // mode on several GPUs: each device's first jobs wait for the step's update of their stages,
    // which with in-call steps is the backlog at the calls' boundary (Model::make_plan says why).
    size_t light_leading_stages = 0;
};

// 2.5: at most two fifths of the largest other stage. At 2 (half), Qwen3-8B's first stage on two
// H200s held the embedding and two decoder layers while its measured time included the table's
// dense gradient, and three once the table's rows alone came down (17 ms less for the stage):
// [4,3,6,5,5,6,6,4], 15,457-15,525 tokens/s, devices starting 127-133 ms into the call. At 2.5
// the re-plan gives [3,2,6,6,5,6,6,5]: 15,878-15,963 tokens/s, starting at 92-100 ms, in the
// same lease (bench/RESULTS.md, round 28).
constexpr double kLightStageWeight = 2.5;

// 1.5: each device's second stage at most two thirds of the largest other stage. Its gradients
// are final second last on its device, so its update is also the calls' boundary's backlog: with
// Qwen3-8B on two H200s, [3,2,6,6,5,6,6,5] left stages 0-3's updates (16 layers and the table's
// rows, ~250 ms of the optimizer) between the last backward jobs and the next call's forward of
// stage 3, and device 1 waited 100 ms for stage 3's weights. At 1.5 the re-plan gives
// [3,3,4,4,6,6,7,6] or [3,2,4,4,7,6,7,6]: 16,288 / 16,358 tokens/s, the optimizer 0.86-0.88
// hidden, against [3,2,6,6,5,6,6,5]'s 15,728 and 0.82 in the same lease (bench/RESULTS.md,
// round 29).
constexpr double kSecondLightStageWeight = 1.5;

// The factor plan_balanced puts on stage `stage`'s cost under `r` (light_leading_stages).
double stage_cost_weight(const PlanRequest &r, size_t stage);

// Device bytes stage [first, end) of a plan over `r.layers` needs while it computes: its fixed
// bytes and the activation working set of its worst job for `r.tokens` tokens (see
// stage_planner.cpp for the model). `end == r.layers.size()` is the last stage (the fused tail).
double stage_footprint(const PlanRequest &r, size_t first, size_t end);

// Splits layers into at least `min_stages` contiguous non-empty stages minimising the most
// expensive stage (a leading stage's cost weighted, see light_leading_stages; exact, by dynamic
// programming over the prefix sums), where no stage's fixed bytes exceed
// `max_stage_weight_bytes` and no stage's footprint exceeds `max_stage_bytes` (a layer over the
// latter alone still gets a stage of its own: the estimate is an estimate, and the allocator has
// the last word). More stages are used when memory needs them. Throws InvalidArgument when a
// single layer's fixed bytes exceed their limit.
std::vector<Stage> plan_balanced(const PlanRequest &r);

// Several devices, a fused call: among the cuts that fit memory as in plan_balanced (and at
// least two stages), the one whose call fused_call_ms (engine/fused_schedule.h) models as
// shortest on `devices` devices with `microbatches` microbatches, from measured per-layer
// compute times (`forward_ms`: in a forward job; `backward_ms`: in a backward job or the tail).
// The balanced plan minimises the slowest stage; this one the call: on two GPUs the odd job
// count gives one device a job more, and fewer stages recompute fewer layers. The host is not
// modelled, so the candidates cost it no more than plan_balanced(r) does: no more stages and a
// tail of at least as many fixed bytes; among them a plan with more stages must be modelled 1%
// faster (its hand-offs are not modelled). Stage counts whose cuts are too many to try are
// skipped. `modelled_ms` (may be null) receives the winner's modelled time. Nothing tried:
// plan_balanced(r), which is always a candidate, so the result is never modelled slower.
std::vector<Stage> plan_for_devices(const PlanRequest &r, const std::vector<double> &forward_ms,
                                    const std::vector<double> &backward_ms, size_t devices,
                                    size_t microbatches, double *modelled_ms = nullptr);

// Stages from explicit sizes; throws InvalidArgument unless they are positive and cover every
// layer exactly.
std::vector<Stage> plan_explicit(const std::vector<int> &layers_per_stage, size_t num_layers);

} // namespace rp
