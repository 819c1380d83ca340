// The pipeline model and the plan search of src/engine/pipeline_model.cpp, against schedules
// worked out by hand and against an exhaustive search over every plan of a small model. Pure
// arithmetic in double: exact comparisons up to 1e-9 relative.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/pipeline_model.h"

using rp::LayerJobCosts;
using rp::PlanRequest;
using rp::Stage;

namespace {

int failures = 0;

void check(bool ok, const std::string &what) {
    if (!ok) {
        std::fprintf(stderr, "FAILED: %s\n", what.c_str());
        ++failures;
    }
}

bool close(double a, double b) { return std::fabs(a - b) <= 1e-9 * std::max(1.0, std::fabs(b)); }

std::vector<Stage> plan_of(const std::vector<size_t> &sizes) {
    std::vector<Stage> stages;
    size_t at = 0;
    for (size_t n : sizes) {
        stages.push_back({at, at + n});
        at += n;
    }
    return stages;
}

std::string str(const std::vector<Stage> &p) {
    std::string s = "[";
    for (const Stage &st : p)
        s += (s.size() > 1 ? ", " : "") + std::to_string(st.end_layer - st.first_layer);
    return s + "]";
}

PlanRequest request(size_t layers, size_t min_stages) {
    PlanRequest r;
    r.costs.assign(layers, 1.0);
    r.layers.assign(layers, rp::LayerFootprint{});
    r.min_stages = min_stages;
    return r;
}

void hand_computed_schedules() {
    // Three one-layer stages, one device: the jobs F0, F1, tail, B1, B0 one after the other.
    std::vector<LayerJobCosts> c(3, LayerJobCosts{1, 3, 4});
    for (size_t m : {1, 2, 5})
        check(close(rp::predicted_call_ms(plan_of({1, 1, 1}), c, 1, m), 1 + 1 + 4 + 3 + 3),
              "one device: the sum of the jobs, microbatches " + std::to_string(m));
    // Two one-layer stages on two devices, two microbatches: F0 (2 ms) on device 0, the tail
    // (4 ms) on device 1, B0 (6 ms) on device 0. F0 ends its microbatches at 1 and 2; the tail
    // starts microbatch 0 at 1 (F0's first), ends it at 3, microbatch 1 at 5; B0 starts its
    // microbatch 0 at 3 (the tail's first) and ends at 6, microbatch 1 at 9.
    std::vector<LayerJobCosts> two = {{2, 6, 0}, {0, 0, 4}};
    check(close(rp::predicted_call_ms(plan_of({1, 1}), two, 2, 2), 9), "two devices, 2 microbatches");
    // One microbatch: no overlap between consecutive jobs.
    check(close(rp::predicted_call_ms(plan_of({1, 1}), two, 2, 1), 12), "two devices, 1 microbatch");
}

// A 9-layer model shaped like a language model: a cheap first layer, uniform middle layers, an
// expensive last layer (the head), and forward : backward job = 1 : 3.
std::vector<LayerJobCosts> lm_like() {
    std::vector<LayerJobCosts> c;
    c.push_back({0.1, 0.2, 0.2});
    for (int i = 0; i < 7; ++i)
        c.push_back({1, 3, 3});
    c.push_back({4, 8, 12});
    return c;
}

void all_plans(size_t n, size_t at, std::vector<size_t> &sizes,
               std::vector<std::vector<size_t>> &out) {
    if (at == n) {
        out.push_back(sizes);
        return;
    }
    for (size_t k = 1; at + k <= n; ++k) {
        sizes.push_back(k);
        all_plans(n, at + k, sizes, out);
        sizes.pop_back();
    }
}

void search_finds_the_best_plan() {
    const std::vector<LayerJobCosts> c = lm_like();
    std::vector<std::vector<size_t>> plans;
    std::vector<size_t> sizes;
    all_plans(c.size(), 0, sizes, plans);
    for (size_t devices : {2, 3})
        for (size_t microbatches : {2, 4, 8}) {
            const size_t min_stages = 2 * devices;
            double best = 1e300;
            for (const auto &p : plans)
                if (p.size() >= min_stages)
                    best = std::min(best, rp::predicted_call_ms(plan_of(p), c, devices, microbatches));
            std::vector<Stage> even;
            for (size_t k = 0; k < min_stages; ++k)
                even.push_back({c.size() * k / min_stages, c.size() * (k + 1) / min_stages});
            const PlanRequest r = request(c.size(), min_stages);
            const std::vector<Stage> got = rp::improve_for_pipeline(r, even, c, devices, microbatches);
            const double got_ms = rp::predicted_call_ms(got, c, devices, microbatches);
            const std::string what = std::to_string(devices) + " devices, " +
                                     std::to_string(microbatches) + " microbatches: " + str(got) +
                                     " predicts " + std::to_string(got_ms) + ", the best plan " +
                                     std::to_string(best);
            check(close(got_ms, best), what);
            check(got.size() >= min_stages, what + " (too few stages)");
        }
}

void memory_limits_and_the_start_are_respected() {
    const std::vector<LayerJobCosts> c = lm_like();
    PlanRequest r = request(c.size(), 4);
    for (auto &f : r.layers)
        f.fixed_bytes = 1;
    r.max_stage_weight_bytes = 2; // at most two layers per stage
    const std::vector<Stage> start = plan_of({2, 2, 2, 2, 1});
    const std::vector<Stage> got = rp::improve_for_pipeline(r, start, c, 2, 4);
    for (const Stage &s : got)
        check(s.end_layer - s.first_layer <= 2, "a stage over the memory limit in " + str(got));
    check(rp::predicted_call_ms(got, c, 2, 4) <= rp::predicted_call_ms(start, c, 2, 4),
          "worse than the start: " + str(got));
    check(got.front().first_layer == 0 && got.back().end_layer == c.size(),
          "does not cover the layers: " + str(got));
    for (size_t i = 0; i + 1 < got.size(); ++i)
        check(got[i].end_layer == got[i + 1].first_layer, "not contiguous: " + str(got));
    check(str(rp::improve_for_pipeline(r, start, c, 2, 4)) == str(got), "not deterministic");
}

} // namespace

int main() {
    hand_computed_schedules();
    search_finds_the_best_plan();
    memory_limits_and_the_start_are_respected();
    if (failures == 0)
        std::printf("pipeline model: all checks passed\n");
    return failures == 0 ? 0 : 1;
}
