// JSON model spec -> layer list. The only place that knows the spec format.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/layer.h"

namespace rp {

// Builds the k-th caller-defined layer ({"type": "caller", "def": k} in a spec).
using CallerLayerSource = std::function<std::unique_ptr<Layer>(size_t k)>;

// Throws rp::Error(InvalidArgument) naming the offending layer ("layer 2 (linear): ..."). Every
// one of the `num_caller_layers` declared layers must be used exactly once.
std::vector<std::unique_ptr<Layer>> parse_model_spec(const std::string &json_text,
                                                     const CallerLayerSource &caller_layer = {},
                                                     size_t num_caller_layers = 0);

} // namespace rp
