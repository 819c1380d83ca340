#include "engine/stage_planner.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "base/error.h"
#include "engine/fused_schedule.h"

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

// plan_for_devices tries at most this many cuts per stage count (under a second of modelling).
constexpr double kMaxPlansSearched = 2e6;

// n choose k, as a double (only compared with kMaxPlansSearched).
double binomial(size_t n, size_t k) {
    double c = 1;
    for (size_t i = 1; i <= k; ++i)
        c = c * static_cast<double>(n - k + i) / static_cast<double>(i);
    return c;
}

// Prefix sums of a request's layers and the memory limits stages must keep.
struct StageLimits {
    const PlanRequest &r;
    std::vector<double> prefix, mem, act;

    explicit StageLimits(const PlanRequest &req) : r(req) {
        const size_t n = r.costs.size();
        require(r.layers.size() == n, "stage planner: one footprint per layer is needed");
        prefix.assign(n + 1, 0.0);
        mem.assign(n + 1, 0.0);
        act.assign(n + 1, 0.0);
        for (size_t i = 0; i < n; ++i) {
            prefix[i + 1] = prefix[i] + r.costs[i];
            mem[i + 1] = mem[i] + r.layers[i].fixed_bytes;
            act[i + 1] = act[i] + r.layers[i].activation_bytes_per_token;
            if (r.max_stage_weight_bytes > 0 && r.layers[i].fixed_bytes > r.max_stage_weight_bytes)
                fail(ErrorKind::InvalidArgument,
                     "layer " + std::to_string(i) + " alone needs " +
                         std::to_string(r.layers[i].fixed_bytes / 1048576.0) +
                         " MiB on the GPU (weights and gradients in the model dtype, and its "
                         "workspace), more than a stage may use (" +
                         std::to_string(r.max_stage_weight_bytes / 1048576.0) + " MiB, " +
                         r.weight_limit_source + ")");
        }
    }
    size_t layers() const { return r.costs.size(); }

    // Whether stage [j, i) fits; `act_max`: the largest per-token activation figure among its
    // layers. Growing a stage (smaller j or larger i) only adds bytes, so a search may stop
    // extending a stage at the first misfit. A single layer always fits the total limit: it
    // cannot be split, and the estimate may be pessimistic.
    bool fits(size_t j, size_t i, double act_max) const {
        if (r.max_stage_weight_bytes > 0 && mem[i] - mem[j] > r.max_stage_weight_bytes)
            return false;
        if (r.max_stage_bytes <= 0 || i - j == 1)
            return true;
        return mem[i] - mem[j] + working_set(r, act[i] - act[j], act_max, i == layers()) <=
               r.max_stage_bytes;
    }

    // Fewest stages memory allows: packing each stage as far as it fits, from the front, is
    // optimal because every part of a fitting stage fits too (a part that ends the model is
    // judged as the tail, as is the whole).
    size_t fewest_stages() const {
        const size_t n = layers();
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
        return count;
    }
};

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

double stage_cost_weight(const PlanRequest &r, size_t stage) {
    if (stage < r.light_leading_stages)
        return kLightStageWeight;
    if (stage < 2 * r.light_leading_stages)
        return kSecondLightStageWeight;
    return 1.0;
}

std::vector<Stage> plan_balanced(const PlanRequest &r) {
    const StageLimits limits(r);
    const size_t n = limits.layers();
    auto fits = [&](size_t j, size_t i, double act_max) { return limits.fits(j, i, act_max); };
    const std::vector<double> &prefix = limits.prefix;
    // Fewest stages memory allows; the DP then balances cost from that count on.
    const size_t k_min =
        std::max(std::max<size_t>(1, std::min(r.min_stages, n)), limits.fewest_stages());
    const double inf = std::numeric_limits<double>::infinity();
    for (size_t num_stages = std::min(k_min, n); num_stages <= n; ++num_stages) {
        // best[k][i]: smallest maximum stage cost splitting the first i layers into k stages.
        std::vector<std::vector<double>> best(num_stages + 1, std::vector<double>(n + 1, inf));
        std::vector<std::vector<size_t>> cut(num_stages + 1, std::vector<size_t>(n + 1, 0));
        best[0][0] = 0.0;
        for (size_t k = 1; k <= num_stages; ++k) {
            const double weight = stage_cost_weight(r, k - 1);
            for (size_t i = k; i <= n; ++i) {
                double act_max = 0;
                for (size_t j = i; j-- > k - 1;) {
                    act_max = std::max(act_max, r.layers[j].activation_bytes_per_token);
                    if (!fits(j, i, act_max))
                        break; // longer stages only grow
                    double c = std::max(best[k - 1][j], weight * (prefix[i] - prefix[j]));
                    if (c < best[k][i]) {
                        best[k][i] = c;
                        cut[k][i] = j;
                    }
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

std::vector<Stage> plan_for_devices(const PlanRequest &r, const std::vector<double> &forward_ms,
                                    const std::vector<double> &backward_ms, size_t devices,
                                    size_t microbatches, double *modelled_ms) {
    const StageLimits limits(r);
    const size_t n = limits.layers();
    require(forward_ms.size() == n && backward_ms.size() == n,
            "stage planner: one forward and one backward time per layer are needed");
    const size_t fewest = std::max<size_t>(std::min<size_t>(2, n), limits.fewest_stages());
    // The host's side is not in the model, so no plan may cost it more than the balanced one:
    // no more stages (hand-offs), and a tail at least as large (a tail's weights go up once, the
    // other stages' twice). A plan with more stages and a smaller tail measured slower on two
    // H200s although its devices were better balanced: its transfers slowed the optimizer step
    // running beside the call (bench/RESULTS.md, round 6).
    const std::vector<Stage> balanced = plan_balanced(r);
    const size_t most = balanced.size();
    const double least_tail_bytes = limits.mem[n] - limits.mem[balanced.back().first_layer];
    std::vector<size_t> cuts{0}, best_cuts;
    double best_ms = std::numeric_limits<double>::infinity();
    // The last stage, from layer j on, completes `cuts`.
    auto try_tail = [&](size_t j) {
        double act_max = 0;
        for (size_t l = j; l < n; ++l)
            act_max = std::max(act_max, r.layers[l].activation_bytes_per_token);
        if (!limits.fits(j, n, act_max))
            return;
        cuts.push_back(n);
        const double ms =
            fused_call_ms(fused_job_ms(cuts, forward_ms, backward_ms), devices, microbatches);
        // A plan with more stages must be clearly shorter: its hand-offs are not in the model.
        const bool more_stages = !best_cuts.empty() && cuts.size() > best_cuts.size();
        if (ms < best_ms * (more_stages ? 0.99 : 1.0)) {
            best_ms = ms;
            best_cuts = cuts;
        }
        cuts.pop_back();
    };
    // Depth-first over the cuts of `stages` stages from layer j on. A stage stops growing at its
    // first misfit (longer stages only grow) or where the tail left after it would be smaller
    // than the balanced plan's.
    std::function<void(size_t, size_t)> search = [&](size_t j, size_t stages) {
        if (stages == 1)
            return try_tail(j);
        double act_max = 0;
        for (size_t i = j + 1; i + stages - 1 <= n; ++i) {
            act_max = std::max(act_max, r.layers[i - 1].activation_bytes_per_token);
            if (!limits.fits(j, i, act_max) || limits.mem[n] - limits.mem[i] < least_tail_bytes)
                break;
            cuts.push_back(i);
            search(i, stages - 1);
            cuts.pop_back();
        }
    };
    for (size_t stages = fewest; stages <= most; ++stages)
        if (binomial(n - 1, stages - 1) <= kMaxPlansSearched)
            search(0, stages);
    if (best_cuts.empty())
        return balanced;
    if (modelled_ms)
        *modelled_ms = best_ms;
    std::vector<Stage> stages;
    for (size_t k = 0; k + 1 < best_cuts.size(); ++k)
        stages.push_back({best_cuts[k], best_cuts[k + 1]});
    return stages;
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
