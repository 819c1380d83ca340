// JSON model spec -> layer list. The only place that knows the spec format.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/layer.h"

namespace rp {

// Throws rp::Error(InvalidArgument) naming the offending layer ("layer 2 (linear): ...").
std::vector<std::unique_ptr<Layer>> parse_model_spec(const std::string &json_text);

} // namespace rp
