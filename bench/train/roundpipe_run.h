// The RoundPipe run: the model built through the C API, warm-up, timed iterations
// (forward_backward + asynchronous rp_step), forward_backward alone, optimizer step alone; and
// what the engine says about itself afterwards (plan, devices, host state, timing record).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "options.h"
#include "util.h"

namespace tb {

struct RoundPipeRun {
    // Set once the model exists (also when a later call fails).
    bool created = false;
    double create_ms = 0;
    int32_t num_devices = 0, num_layers = 0;
    int32_t rank = 0, world_size = 1; // rp_model_data_parallel
    int64_t gpu_memory_cap = 0;
    // Set once every phase has run.
    bool finished = false;
    std::vector<int32_t> plan; // rp_model_stage_plan after the timed steps
    std::vector<int32_t> backward_plan; // rp_model_backward_stage_plan, likewise
    double loop_ms = 0;        // wall time of the timed loop
    std::vector<double> losses; // warm-up and timed iterations
    std::vector<double> fb_ms, step_ms, fb_only_ms, opt_ms;
    json loop_thread_cpu; // CPU time per thread name over the timed loop (thread_cpu.h)
    int64_t peak_gpu_warmup = -1, peak_gpu_steady = -1, peak_rss = 0;
    int64_t host_state_bytes = 0, host_state_elements = 0;
    std::string trace_json; // of the last timed forward_backward
    std::string trace_alone_json; // of the last forward_backward without a step (--fb-only-steps)
};

// Fills `r` as it goes; throws BenchError when a call fails or a loss is not finite.
void run_roundpipe(RoundPipeRun &r, const Options &o, int num_gpus);

// The engine's host-state bytes per trainable and per frozen parameter for these options (host
// memory mode, dtypes, LoRA): rp_model_host_state_bytes of tiny models on a CPU device after one
// training step (the optimizer state exists from the first step on), without and with the
// adapters. Taken before the real model is built, to skip runs whose host state cannot fit.
struct HostBytesPerParam {
    double trainable = 0, frozen = 0;
};
HostBytesPerParam engine_host_bytes_per_param(const Options &o);

} // namespace tb
