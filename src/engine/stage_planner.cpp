#include "engine/stage_planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "base/error.h"

namespace rp {
namespace {

// The activation working set of a stage, for T tokens per microbatch, from the sum and the
// largest of its layers' per-token figures (a_l: what a forward with gradients keeps for
// backward). Microbatches run one after the other inside a job, so only one is in flight:
//  - a stage that keeps its graph (the fused tail, or any stage recomputed at stage grain):
//    T * (sum a_l + a_max / 2): every layer's saved tensors, plus the backward's transient
//    gradients of one layer's intermediates while that layer's saved tensors are still alive
//    (a decoder layer's backward holds about a third of its figure; half is the margin);
//  - a stage recomputed at layer grain: T * (1.5 a_max + (sum a_l - a_max) / 16): one layer's
//    graph and transient, plus the inputs of the other layers of the stage kept by the
//    gradient-free pass (a decoder layer's input is 1/30 of its figure, a linear layer's 1/4);
//  - a forward without gradients: T * a_max / 2, one layer's intermediates at a time.
// A fused call's non-tail stages run a forward job and a backward job; the backward is larger.
double working_set(const PlanRequest &r, double sum, double max, bool last) {
    if (r.use == StageUse::Inference)
        return r.tokens * 0.5 * max;
    const bool keeps_graph = (r.use == StageUse::Fused && last) || r.grain == RecomputeGrain::Stage;
    return r.tokens * (keeps_graph ? sum + 0.5 * max : 1.5 * max + (sum - max) / 16.0);
}

} // namespace

double stage_footprint(const PlanRequest &r, size_t first, size_t end) {
    double fixed = 0, sum = 0, max = 0;
    for (size_t l = first; l < end; ++l) {
        fixed += r.layers[l].fixed_bytes;
        sum += r.layers[l].activation_bytes_per_token;
        max = std::max(max, r.layers[l].activation_bytes_per_token);
    }
    return fixed + working_set(r, sum, max, end == r.layers.size());
}

std::vector<Stage> plan_balanced(const PlanRequest &r) {
    const size_t n = r.costs.size();
    require(r.layers.size() == n, "stage planner: one footprint per layer is needed");
    const double max_fixed = r.max_stage_weight_bytes, max_total = r.max_stage_bytes;
    const bool fixed_limited = max_fixed > 0, total_limited = max_total > 0;
    std::vector<double> prefix(n + 1, 0.0), mem(n + 1, 0.0), act(n + 1, 0.0);
    for (size_t i = 0; i < n; ++i) {
        prefix[i + 1] = prefix[i] + r.costs[i];
        mem[i + 1] = mem[i] + r.layers[i].fixed_bytes;
        act[i + 1] = act[i] + r.layers[i].activation_bytes_per_token;
        if (fixed_limited && r.layers[i].fixed_bytes > max_fixed)
            fail(ErrorKind::InvalidArgument,
                 "layer " + std::to_string(i) + " needs " +
                     std::to_string(r.layers[i].fixed_bytes / 1048576.0) +
                     " MiB on the GPU (weights and gradients), more than a stage may use (" +
                     std::to_string(max_fixed / 1048576.0) +
                     " MiB, a third of the GPU memory cap); raise the cap or split the layer");
    }
    // Whether stage [j, i) fits. Growing a stage (smaller j) only adds bytes, so the DP below
    // stops extending a stage at the first misfit. A single layer always fits the total limit:
    // it cannot be split, and the estimate may be pessimistic.
    auto fits = [&](size_t j, size_t i, double act_max) {
        if (fixed_limited && mem[i] - mem[j] > max_fixed)
            return false;
        if (!total_limited || i - j == 1)
            return true;
        return mem[i] - mem[j] + working_set(r, act[i] - act[j], act_max, i == n) <= max_total;
    };
    // Fewest stages memory allows: packing each stage as far as it fits, from the front, is
    // optimal because every part of a fitting stage fits too (a part that ends the model is
    // judged as the tail, as is the whole). The DP then balances cost from that count on.
    size_t k_min = std::max<size_t>(1, std::min(r.min_stages, n));
    {
        size_t count = 0;
        for (size_t j = 0; j < n; ++count) {
            size_t i = j + 1;
            double act_max = r.layers[j].activation_bytes_per_token;
            while (i < n) {
                double grown = std::max(act_max, r.layers[i].activation_bytes_per_token);
                if (!fits(j, i + 1, grown))
                    break;
                act_max = grown;
                ++i;
            }
            j = i;
        }
        k_min = std::max(k_min, count);
    }
    const double inf = std::numeric_limits<double>::infinity();
    for (size_t num_stages = std::min(k_min, n); num_stages <= n; ++num_stages) {
        // best[k][i]: smallest maximum stage cost splitting the first i layers into k stages.
        std::vector<std::vector<double>> best(num_stages + 1, std::vector<double>(n + 1, inf));
        std::vector<std::vector<size_t>> cut(num_stages + 1, std::vector<size_t>(n + 1, 0));
        best[0][0] = 0.0;
        for (size_t k = 1; k <= num_stages; ++k)
            for (size_t i = k; i <= n; ++i) {
                double act_max = 0;
                for (size_t j = i; j-- > k - 1;) {
                    act_max = std::max(act_max, r.layers[j].activation_bytes_per_token);
                    if (!fits(j, i, act_max))
                        break; // longer stages only grow
                    double c = std::max(best[k - 1][j], prefix[i] - prefix[j]);
                    if (c < best[k][i]) {
                        best[k][i] = c;
                        cut[k][i] = j;
                    }
                }
            }
        if (best[num_stages][n] == inf)
            continue;
        std::vector<Stage> stages(num_stages);
        size_t end = n;
        for (size_t k = num_stages; k >= 1; --k) {
            stages[k - 1] = {cut[k][end], end};
            end = cut[k][end];
        }
        return stages;
    }
    fail(ErrorKind::Internal, "stage planner found no feasible plan");
}

std::vector<Stage> plan_explicit(const std::vector<int> &sizes, size_t num_layers) {
    std::vector<Stage> stages;
    size_t next = 0;
    for (size_t s = 0; s < sizes.size(); ++s) {
        require(sizes[s] > 0, "stage plan: stage " + std::to_string(s) + " has " +
                                  std::to_string(sizes[s]) + " layers; each needs at least one");
        stages.push_back({next, next + static_cast<size_t>(sizes[s])});
        next += static_cast<size_t>(sizes[s]);
    }
    require(next == num_layers, "stage plan covers " + std::to_string(next) +
                                    " layers but the model has " + std::to_string(num_layers));
    return stages;
}

} // namespace rp
