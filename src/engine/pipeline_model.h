// A model of how long a fused training call takes on several devices, and a plan search against
// it. The planner's own objective (plan_balanced: the most expensive stage as small as possible)
// ignores where the jobs run; on several devices the round robin puts a stage's jobs on fixed
// devices, jobs overlap only as far as their microbatches let them, and a balanced-looking plan
// can leave one device idle a tenth of the call (bench/RESULTS.md, round 6).
#pragma once
#include <cstddef>
#include <vector>

#include "engine/stage_planner.h"

namespace rp {

// What one layer adds to each kind of job that runs it, in milliseconds: a forward job, a
// backward job (recompute and backward) and the fused tail (forward, loss and backward once).
struct LayerJobCosts {
    double forward = 0, backward = 0, tail = 0;
};

// The length of a fused call with `stages` (the last is the tail) on `devices` devices and
// `microbatches` microbatches, as the pipeline runs it: the jobs (forward stages, the tail,
// backward stages deepest first) go round robin to the devices; a device runs its jobs in
// order, a job its microbatches in order, each taking its job's cost / microbatches; a job's
// microbatch m starts once the previous job has finished its microbatch m. Transfers are not
// modelled (they overlap compute on their own streams).
double predicted_call_ms(const std::vector<Stage> &stages, const std::vector<LayerJobCosts> &costs,
                         size_t devices, size_t microbatches);

// A plan with a predicted call no longer than `start`'s: a local search from `start` and from
// even splits into r.min_stages .. r.min_stages + 2 stages, moving one boundary, splitting a stage
// or merging two, keeping every stage within r's memory limits (stage_footprint and the fixed
// bytes) and at least r.min_stages stages. Deterministic.
std::vector<Stage> improve_for_pipeline(const PlanRequest &r, const std::vector<Stage> &start,
                                        const std::vector<LayerJobCosts> &costs, size_t devices,
                                        size_t microbatches);

} // namespace rp
