// Cuts the layer list into contiguous stages.
#pragma once
#include <vector>

namespace rp {

struct Stage {
    size_t first_layer; // inclusive
    size_t end_layer;   // exclusive
};

// Splits layers into at least `min_stages` contiguous non-empty stages minimising the most
// expensive stage (exact, by dynamic programming over the prefix sums), where no stage's memory
// (sum of `layer_bytes`) exceeds `max_stage_bytes` (<= 0: no limit). More stages are used when
// the memory limit needs them. Throws InvalidArgument when a single layer exceeds the limit.
std::vector<Stage> plan_balanced(const std::vector<double> &layer_costs,
                                 const std::vector<double> &layer_bytes, size_t min_stages,
                                 double max_stage_bytes);

// Stages from explicit sizes; throws InvalidArgument unless they are positive and cover every
// layer exactly.
std::vector<Stage> plan_explicit(const std::vector<int> &layers_per_stage, size_t num_layers);

} // namespace rp
