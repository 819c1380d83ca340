// The times the automatic re-plan weighs stages by (src/engine/stage_times.h), against values
// worked out by hand from job traces written out here: a stage's weight is the sum of its jobs'
// compute on one device and its longest job on several; forward jobs and backward jobs or the
// tail are kept apart; the fastest of two calls on one plan takes each stage's shorter time (an
// unmeasured -1 never wins), and a call on another plan replaces the times. Durations are sums of
// a few small binary fractions: exact in double, so the checks compare exactly.
#include <cstdio>
#include <string>
#include <vector>

#include "engine/stage_times.h"

namespace {

int failures = 0;

void check_times(const std::vector<double> &got, const std::vector<double> &want,
                 const char *what) {
    if (got == want)
        return;
    std::printf("FAILED: %s: got [", what);
    for (double g : got)
        std::printf(" %g", g);
    std::printf(" ], want [");
    for (double w : want)
        std::printf(" %g", w);
    std::printf(" ]\n");
    ++failures;
}

void check(bool ok, const char *what) {
    if (!ok) {
        std::printf("FAILED: %s\n", what);
        ++failures;
    }
}

// A job with one compute span per entry of `compute_ms`, laid end to end from `start`, and a
// weight upload before them (which must not count).
rp::JobTrace job(size_t index, size_t stage, rp::JobKind kind, std::vector<double> compute_ms,
                 double start = 0) {
    rp::JobTrace j{index, stage, 0, kind, {}, false};
    j.spans.push_back({"weights", index, start - 7, start, 1 << 20, "weights"});
    for (double ms : compute_ms) {
        j.spans.push_back({"compute", index, start, start + ms, -1, ""});
        start += ms + 1; // a gap between microbatches, not compute
    }
    return j;
}

const std::vector<rp::Stage> two_stages{{0, 3}, {3, 5}};

// One fused call on two stages, two microbatches: stage 0's forward, the tail, stage 0's backward.
std::vector<rp::JobTrace> fused_call(double scale) {
    return {job(0, 0, rp::JobKind::Forward, {10 * scale, 12 * scale}, 100),
            job(1, 1, rp::JobKind::Tail, {5 * scale, 5.5 * scale}, 130),
            job(2, 0, rp::JobKind::Backward, {20 * scale, 22 * scale}, 150)};
}

void one_device_sums_the_jobs() {
    const rp::StageTimes t = rp::stage_times_of(fused_call(1), two_stages, false);
    check_times(t.weight, {64, 10.5},
                "one device: stage 0 weighs 10 + 12 + 20 + 22, the tail 10.5");
    check_times(t.forward, {22, -1}, "forward jobs: stage 0's 22, no forward job for the tail");
    check_times(t.backward, {42, 10.5}, "backward job and tail");
    check(t.microbatches == 2, "two compute spans per job: two microbatches");
}

void several_devices_take_the_longest_job() {
    const rp::StageTimes t = rp::stage_times_of(fused_call(1), two_stages, true);
    check_times(t.weight, {42, 10.5}, "several devices: stage 0 weighs its backward job, 42");
}

void jobs_of_another_plan_are_left_out() {
    std::vector<rp::JobTrace> trace = fused_call(1);
    trace.push_back(job(3, 2, rp::JobKind::Forward, {1000}));
    const rp::StageTimes t = rp::stage_times_of(trace, two_stages, false);
    check_times(t.weight, {64, 10.5}, "a job of a stage the plan lacks changes nothing");
}

void uploads_for_the_next_call_are_left_out() {
    std::vector<rp::JobTrace> trace = fused_call(1);
    rp::JobTrace next = job(3, 0, rp::JobKind::Forward, {});
    next.next_call = true; // only a weight upload, no compute
    trace.push_back(next);
    const rp::StageTimes t = rp::stage_times_of(trace, two_stages, false);
    check_times(t.forward, {22, -1}, "the next call's upload is no forward job of 0 ms");
}

void fastest_takes_each_stage_shorter_time() {
    // Call 2 slowed on stage 0 (host work), call 3 slowed on the tail: each stage's shorter.
    rp::StageTimes slow_stage0 = rp::stage_times_of(fused_call(1), two_stages, false);
    slow_stage0.weight[0] = 640;
    slow_stage0.forward[0] = 220;
    rp::StageTimes slow_tail = rp::stage_times_of(fused_call(1), two_stages, false);
    slow_tail.weight[1] = 105;
    slow_tail.backward[1] = 105;
    const rp::StageTimes t = rp::fastest(slow_stage0, slow_tail);
    check_times(t.weight, {64, 10.5}, "fastest: each stage's shorter weight");
    check_times(t.forward, {22, -1},
                "fastest: each stage's shorter forward, -1 kept where neither measured");
    check_times(t.backward, {42, 10.5}, "fastest: each stage's shorter backward");
    const rp::StageTimes same = rp::fastest(slow_tail, slow_stage0);
    check_times(same.weight, t.weight, "fastest is symmetric");
}

void unmeasured_never_wins() {
    rp::StageTimes a = rp::stage_times_of(fused_call(1), two_stages, false);
    rp::StageTimes b = a;
    a.forward[0] = -1;
    check_times(rp::fastest(a, b).forward, {22, -1}, "-1 gives way to a measurement (earlier)");
    check_times(rp::fastest(b, a).forward, {22, -1}, "-1 gives way to a measurement (later)");
}

void another_plan_replaces_the_times() {
    const rp::StageTimes fast = rp::stage_times_of(fused_call(0.5), two_stages, false);
    const std::vector<rp::Stage> other{{0, 2}, {2, 5}};
    const rp::StageTimes later = rp::stage_times_of(fused_call(1), other, false);
    const rp::StageTimes t = rp::fastest(fast, later);
    check_times(t.weight, {64, 10.5}, "another plan: the later call's times alone");
    check(t.stages.size() == 2 && t.stages[0].end_layer == 2, "another plan: the later plan");
}

// A backward's recompute run ahead of its gradient is a span of its own (kRecomputeAhead): its
// time counts, the wait before the rest of the microbatch does not, and the microbatches stay two.
void recompute_ahead_counts_its_time_not_a_microbatch() {
    std::vector<rp::JobTrace> trace = fused_call(1);
    rp::JobTrace &backward = trace[2];
    backward.spans.resize(1); // the weight upload; the microbatches again, each in two parts
    double start = 150;
    for (double ms : {20.0, 22.0}) {
        backward.spans.push_back({"compute", 2, start, start + ms / 4, -1, rp::kRecomputeAhead});
        start += ms / 4 + 30; // waiting for the gradient: not compute
        backward.spans.push_back({"compute", 2, start, start + ms * 3 / 4, -1, ""});
        start += ms * 3 / 4 + 1;
    }
    const rp::StageTimes t = rp::stage_times_of(trace, two_stages, false);
    check_times(t.backward, {42, 10.5}, "a split backward weighs its two parts, not the waits");
    check(t.microbatches == 2, "a split backward still has two microbatches");
}

} // namespace

int main() {
    recompute_ahead_counts_its_time_not_a_microbatch();
    one_device_sums_the_jobs();
    several_devices_take_the_longest_job();
    jobs_of_another_plan_are_left_out();
    uploads_for_the_next_call_are_left_out();
    fastest_takes_each_stage_shorter_time();
    unmeasured_never_wins();
    another_plan_replaces_the_times();
    if (failures) {
        std::printf("%d check(s) failed\n", failures);
        return 1;
    }
    std::printf("all stage-times checks passed\n");
    return 0;
}
