// The timing record of the last timed forward_backward (rp_model_trace_json, Chrome trace
// JSON): its device events by job and stream, the bytes its transfers moved (each transfer
// event carries args.bytes), how busy each PCIe direction was, and per-device overlap figures.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "util.h"

namespace tb {

struct Span {
    double start, end; // ms from the call's start
};

struct StreamEvent {
    Span span;
    double bytes = 0;       // transfers: args.bytes; 0 for compute
    bool gradients = false; // a download of weight gradients (args.content)
};

struct TraceJob {
    size_t job = 0, stage = 0, device = 0;
    std::string kind;                                      // forward, tail, backward
    std::map<std::string, std::vector<StreamEvent>> streams; // by tid, in trace order
};

struct Trace {
    std::map<size_t, TraceJob> jobs;
};

// The device events of a trace (host events and metadata are skipped). Throws BenchError when
// a transfer event ("weights", "activation_upload", "download") lacks args.bytes.
Trace parse_trace(const std::string &text);

// Bytes over PCIe in one forward_backward, each way, summed from the transfer events.
struct PcieBytes {
    double h2d_weights = 0, h2d_activations = 0, d2h_grads = 0, d2h_activations = 0;
    double h2d_busy_ms = 0, d2h_busy_ms = 0; // union of each direction's spans, summed over devices
    json per_device = json::array();
    double h2d() const { return h2d_weights + h2d_activations; }
    double d2h() const { return d2h_grads + d2h_activations; }
};
PcieBytes pcie_bytes(const Trace &trace);

// Per device, as bench/trace_summary.py: the compute window (first to last compute), how much
// of it had no compute running, and how much of the weight-upload time overlapped compute.
json trace_devices(const Trace &trace);

// End of the last span of the trace (ms from the call's start).
double trace_end_ms(const Trace &trace);

} // namespace tb
