#include "engine/stage_planner.h"

#include <algorithm>
#include <limits>
#include <string>

#include "engine/error.h"

namespace rp {

std::vector<Stage> plan_balanced(const std::vector<double> &cost, size_t num_stages) {
    const size_t n = cost.size();
    num_stages = std::max<size_t>(1, std::min(num_stages, n));
    std::vector<double> prefix(n + 1, 0.0);
    for (size_t i = 0; i < n; ++i)
        prefix[i + 1] = prefix[i] + cost[i];
    const double inf = std::numeric_limits<double>::infinity();
    // best[k][i]: smallest possible maximum stage cost splitting the first i layers into k stages.
    std::vector<std::vector<double>> best(num_stages + 1, std::vector<double>(n + 1, inf));
    std::vector<std::vector<size_t>> cut(num_stages + 1, std::vector<size_t>(n + 1, 0));
    best[0][0] = 0.0;
    for (size_t k = 1; k <= num_stages; ++k)
        for (size_t i = k; i <= n; ++i)
            for (size_t j = k - 1; j < i; ++j) {
                double c = std::max(best[k - 1][j], prefix[i] - prefix[j]);
                if (c < best[k][i]) {
                    best[k][i] = c;
                    cut[k][i] = j;
                }
            }
    std::vector<Stage> stages(num_stages);
    size_t end = n;
    for (size_t k = num_stages; k >= 1; --k) {
        stages[k - 1] = {cut[k][end], end};
        end = cut[k][end];
    }
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
