// The timing record of one call as plain records: when each device stream and each host thread
// worked, and what the transfers moved. The engine only records; src/api turns the records into
// the Chrome trace JSON of rp_model_trace_json.
#pragma once
#include <cstdint>
#include <string>

namespace rp {

struct TraceEvent {
    std::string name;   // "forward stage 3", or the host activity ("pipeline", "step 2")
    std::string lane;   // device stream ("weights", "compute", ...) or host thread ("caller", ...)
    int device = -1;    // device index; -1 for the host
    double start_us = 0, duration_us = 0; // from the call's start
    // Device events only: the job, its stage and kind ("forward", "tail", "backward").
    size_t job = 0, stage = 0;
    std::string kind;
    int64_t bytes = -1; // transfers: bytes moved; -1 for compute and host events
    std::string content; // transfers: "weights", "activations" or "gradients"
    double enqueued_us = -1; // GPU events: when the host enqueued the work (-1: not recorded)
};

} // namespace rp
