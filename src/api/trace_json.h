// rp_model_trace_json's format: the engine's timing records as Chrome trace JSON.
#pragma once
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine/trace.h"

namespace rp {

// One process per device (pid = device index, named by `device_names`: "cuda:0", "cpu 1") with
// one thread per stream, and the host as process 1000 with one thread per host activity; times
// in microseconds.
std::string chrome_trace_json(const std::vector<TraceEvent> &events,
                              const std::vector<std::string> &device_names);

// The name of each of the model's devices in the trace: "cuda:<index>" for a GPU, "cpu <n>" for
// the n-th CPU worker device.
std::vector<std::string> trace_device_names(const Model &model);

} // namespace rp
