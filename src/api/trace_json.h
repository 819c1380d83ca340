// rp_model_trace_json's format: the engine's timing records as Chrome trace JSON.
#pragma once
#include <string>
#include <vector>

#include "engine/trace.h"

namespace rp {

// One process per device (pid = device index) with one thread per stream, and the host as
// process 1000 with one thread per host activity; times in microseconds.
std::string chrome_trace_json(const std::vector<TraceEvent> &events);

} // namespace rp
