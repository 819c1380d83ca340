// The compute times a training call measured per stage of its plan, which the automatic
// planner's one re-plan on GPUs weighs the stages by (Model::replan_from), and the fastest of
// several calls' times: a call slowed by one-time or host work measures a stage too long, never
// too short.
#pragma once
#include <cstddef>
#include <vector>

#include "engine/pipeline.h"
#include "engine/stage_planner.h"

namespace rp {

struct StageTimes {
    std::vector<Stage> stages; // the plan the times were measured on
    // Per stage, milliseconds of compute: the stage's weight for the planner (one device: the sum
    // of its jobs, which run one after another; several: its longest job, which paces the
    // pipeline), and its forward job's and its backward job's or the tail's (-1: no such job).
    std::vector<double> weight, forward, backward;
    size_t microbatches = 0; // compute spans in a job: one per microbatch
};

// A call's times from its job trace (Pipeline::last_trace) on the plan `stages`.
StageTimes stage_times_of(const std::vector<JobTrace> &trace, const std::vector<Stage> &stages,
                          bool several_devices);

// Per stage, the shorter of two calls' times on the same plan; `later` alone when the plans
// differ (the call shape changed the plan in between).
StageTimes fastest(const StageTimes &earlier, const StageTimes &later);

} // namespace rp
