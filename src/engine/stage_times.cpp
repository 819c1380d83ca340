#include "engine/stage_times.h"

#include <algorithm>

namespace rp {

StageTimes stage_times_of(const std::vector<JobTrace> &trace, const std::vector<Stage> &stages,
                          bool several_devices) {
    StageTimes t;
    t.stages = stages;
    t.weight.assign(stages.size(), 0.0);
    t.forward.assign(stages.size(), -1.0);
    t.backward.assign(stages.size(), -1.0);
    for (const JobTrace &job : trace) {
        if (job.next_call || job.from_last_call || job.stage >= stages.size())
            continue; // an upload for the next call or by the last, or not a job of this plan
        double ms = 0;
        size_t spans = 0;
        for (const TraceSpan &span : job.spans)
            if (span.what == "compute") {
                ms += span.end_ms - span.start_ms;
                if (span.content != kRecomputeAhead) // the first part of a microbatch's span
                    ++spans;
            }
        t.microbatches = std::max(t.microbatches, spans);
        double &weight = t.weight[job.stage];
        weight = several_devices ? std::max(weight, ms) : weight + ms;
        (job.kind == JobKind::Forward ? t.forward : t.backward)[job.stage] = ms;
    }
    return t;
}

namespace {

bool same_plan(const std::vector<Stage> &a, const std::vector<Stage> &b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const Stage &x, const Stage &y) {
        return x.first_layer == y.first_layer && x.end_layer == y.end_layer;
    });
}

// The shorter of two times, -1 (not measured) giving way to a measurement.
double shorter(double a, double b) {
    if (a < 0)
        return b;
    if (b < 0)
        return a;
    return std::min(a, b);
}

} // namespace

StageTimes fastest(const StageTimes &earlier, const StageTimes &later) {
    if (!same_plan(earlier.stages, later.stages))
        return later;
    StageTimes t = later;
    for (size_t s = 0; s < t.stages.size(); ++s) {
        t.weight[s] = shorter(earlier.weight[s], later.weight[s]);
        t.forward[s] = shorter(earlier.forward[s], later.forward[s]);
        t.backward[s] = shorter(earlier.backward[s], later.backward[s]);
    }
    t.microbatches = std::max(earlier.microbatches, later.microbatches);
    return t;
}

} // namespace rp
