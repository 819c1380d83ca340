#include "engine/pipeline_model.h"

#include <algorithm>

namespace rp {
namespace {

double job_cost(const Stage &stage, const std::vector<LayerJobCosts> &costs,
                double LayerJobCosts::*kind) {
    double sum = 0;
    for (size_t l = stage.first_layer; l < stage.end_layer; ++l)
        sum += costs[l].*kind;
    return sum;
}

// Whether every stage fits r's memory limits, as plan_balanced judges them (a single layer
// always fits the total limit: it cannot be split), and there are enough stages.
bool feasible(const PlanRequest &r, const std::vector<Stage> &stages) {
    if (stages.size() < std::min(r.min_stages, r.layers.size()))
        return false;
    for (const Stage &s : stages) {
        if (r.max_stage_weight_bytes > 0) {
            double fixed = 0;
            for (size_t l = s.first_layer; l < s.end_layer; ++l)
                fixed += r.layers[l].fixed_bytes;
            if (fixed > r.max_stage_weight_bytes)
                return false;
        }
        if (r.max_stage_bytes > 0 && s.end_layer - s.first_layer > 1 &&
            stage_footprint(r, s.first_layer, s.end_layer) > r.max_stage_bytes)
            return false;
    }
    return true;
}

std::vector<Stage> even_split(size_t layers, size_t count) {
    std::vector<Stage> stages;
    for (size_t k = 0; k < count; ++k)
        stages.push_back({layers * k / count, layers * (k + 1) / count});
    return stages;
}

// Every plan one step away: a boundary moved by one layer, a stage split in two, two
// neighbouring stages merged.
std::vector<std::vector<Stage>> neighbours(const std::vector<Stage> &p) {
    std::vector<std::vector<Stage>> out;
    for (size_t i = 0; i + 1 < p.size(); ++i) {
        if (p[i].end_layer - p[i].first_layer > 1) { // move the boundary down
            std::vector<Stage> q = p;
            --q[i].end_layer;
            --q[i + 1].first_layer;
            out.push_back(std::move(q));
        }
        if (p[i + 1].end_layer - p[i + 1].first_layer > 1) { // and up
            std::vector<Stage> q = p;
            ++q[i].end_layer;
            ++q[i + 1].first_layer;
            out.push_back(std::move(q));
        }
        std::vector<Stage> merged = p;
        merged[i].end_layer = p[i + 1].end_layer;
        merged.erase(merged.begin() + static_cast<long>(i) + 1);
        out.push_back(std::move(merged));
    }
    for (size_t i = 0; i < p.size(); ++i)
        for (size_t at = p[i].first_layer + 1; at < p[i].end_layer; ++at) {
            std::vector<Stage> q = p;
            q[i].end_layer = at;
            q.insert(q.begin() + static_cast<long>(i) + 1, Stage{at, p[i].end_layer});
            out.push_back(std::move(q));
        }
    return out;
}

} // namespace

double predicted_call_ms(const std::vector<Stage> &stages, const std::vector<LayerJobCosts> &costs,
                         size_t devices, size_t microbatches) {
    if (stages.empty())
        return 0;
    const size_t G = std::max<size_t>(1, devices), M = std::max<size_t>(1, microbatches);
    std::vector<double> jobs;
    for (size_t s = 0; s + 1 < stages.size(); ++s)
        jobs.push_back(job_cost(stages[s], costs, &LayerJobCosts::forward));
    jobs.push_back(job_cost(stages.back(), costs, &LayerJobCosts::tail));
    for (size_t s = stages.size() - 1; s-- > 0;)
        jobs.push_back(job_cost(stages[s], costs, &LayerJobCosts::backward));
    std::vector<double> device_free(G, 0.0);
    std::vector<double> previous_done(M, 0.0); // when the previous job finished microbatch m
    for (size_t j = 0; j < jobs.size(); ++j) {
        double t = device_free[j % G];
        for (size_t m = 0; m < M; ++m) {
            t = std::max(t, previous_done[m]) + jobs[j] / static_cast<double>(M);
            previous_done[m] = t;
        }
        device_free[j % G] = t;
    }
    return *std::max_element(device_free.begin(), device_free.end());
}

std::vector<Stage> improve_for_pipeline(const PlanRequest &r, const std::vector<Stage> &start,
                                        const std::vector<LayerJobCosts> &costs, size_t devices,
                                        size_t microbatches) {
    const size_t n = r.layers.size();
    auto predicted = [&](const std::vector<Stage> &p) {
        return predicted_call_ms(p, costs, devices, microbatches);
    };
    std::vector<std::vector<Stage>> seeds = {start};
    for (size_t k = r.min_stages; k <= r.min_stages + 2 && k <= n; ++k)
        seeds.push_back(even_split(n, k));
    std::vector<Stage> best = start;
    double best_ms = predicted(start);
    // Bounded: each step strictly shortens the prediction, and the budget caps pathological
    // cases (hundreds of layers) at a few hundred milliseconds of host time.
    size_t budget = 200000;
    for (std::vector<Stage> p : seeds) {
        if (!feasible(r, p))
            continue;
        double p_ms = predicted(p);
        for (bool improved = true; improved && budget > 0;) {
            improved = false;
            std::vector<Stage> step;
            double step_ms = p_ms;
            for (std::vector<Stage> &q : neighbours(p)) {
                if (budget == 0)
                    break;
                --budget;
                if (!feasible(r, q))
                    continue;
                const double q_ms = predicted(q);
                if (q_ms < step_ms * (1 - 1e-9)) {
                    step = std::move(q);
                    step_ms = q_ms;
                }
            }
            if (!step.empty()) {
                p = std::move(step);
                p_ms = step_ms;
                improved = true;
            }
        }
        if (p_ms < best_ms * (1 - 1e-9)) {
            best = p;
            best_ms = p_ms;
        }
    }
    return best;
}

} // namespace rp
