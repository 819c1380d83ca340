#include "engine/stage_planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "base/error.h"

namespace rp {

std::vector<Stage> plan_balanced(const std::vector<double> &cost,
                                 const std::vector<double> &bytes, size_t min_stages,
                                 double max_bytes) {
    const size_t n = cost.size();
    const bool limited = max_bytes > 0;
    std::vector<double> prefix(n + 1, 0.0), mem(n + 1, 0.0);
    for (size_t i = 0; i < n; ++i) {
        prefix[i + 1] = prefix[i] + cost[i];
        mem[i + 1] = mem[i] + bytes[i];
        if (limited && bytes[i] > max_bytes)
            fail(ErrorKind::InvalidArgument,
                 "layer " + std::to_string(i) + " needs " + std::to_string(bytes[i] / 1048576.0) +
                     " MiB on the GPU (weights and gradients), more than a stage may use (" +
                     std::to_string(max_bytes / 1048576.0) +
                     " MiB, a third of the GPU memory cap); raise the cap or split the layer");
    }
    // Fewest stages the memory limit allows: a lower bound, the DP below finds a feasible split.
    size_t k_min = std::max<size_t>(1, std::min(min_stages, n));
    if (limited)
        k_min = std::max(k_min, static_cast<size_t>(std::ceil(mem[n] / max_bytes)));
    const double inf = std::numeric_limits<double>::infinity();
    for (size_t num_stages = std::min(k_min, n); num_stages <= n; ++num_stages) {
        // best[k][i]: smallest maximum stage cost splitting the first i layers into k stages.
        std::vector<std::vector<double>> best(num_stages + 1, std::vector<double>(n + 1, inf));
        std::vector<std::vector<size_t>> cut(num_stages + 1, std::vector<size_t>(n + 1, 0));
        best[0][0] = 0.0;
        for (size_t k = 1; k <= num_stages; ++k)
            for (size_t i = k; i <= n; ++i)
                for (size_t j = i; j-- > k - 1;) {
                    if (limited && mem[i] - mem[j] > max_bytes)
                        break; // longer stages only grow
                    double c = std::max(best[k - 1][j], prefix[i] - prefix[j]);
                    if (c < best[k][i]) {
                        best[k][i] = c;
                        cut[k][i] = j;
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
