// Cuts the layer list into contiguous stages.
#pragma once
#include <vector>

namespace rp {

struct Stage {
    size_t first_layer; // inclusive
    size_t end_layer;   // exclusive
};

// Splits layers into `num_stages` contiguous non-empty stages minimising the most expensive
// stage (exact, by dynamic programming over the prefix sums).
std::vector<Stage> plan_balanced(const std::vector<double> &layer_costs, size_t num_stages);

// Stages from explicit sizes; throws InvalidArgument unless they are positive and cover every
// layer exactly.
std::vector<Stage> plan_explicit(const std::vector<int> &layers_per_stage, size_t num_layers);

} // namespace rp
