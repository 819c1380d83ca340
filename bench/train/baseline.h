// The baseline: a plain libtorch Qwen3 (Hugging Face's arithmetic) trained on one device in
// this process. CUDA: fp32 weights, bf16/f16 autocast for the forward, fused AdamW on the GPU,
// no activation checkpointing (what "plain PyTorch" measured in DESIGN.md section 7). CPU:
// fp32, no autocast, PyTorch's fused CPU AdamW.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "options.h"

namespace tb {

struct BaselineResult {
    int64_t microbatches = 0;
    std::optional<double> bytes_estimate; // CUDA runs: what the baseline should need on the GPU
    std::optional<int64_t> params;        // once its model is built
    std::string status;                   // ok, skipped: ..., out of memory: ..., error: ...
    // status ok:
    std::string mode;
    int steps = 0;
    double iter_ms = 0, tokens_per_s = 0, loss_first = 0, loss_last = 0;
    // status ok or out of memory: the allocator peak (-1 on CPU devices: none).
    bool has_peak = false;
    int64_t peak_gpu_bytes = -1;
};

// Trains the baseline (--baseline-warmup, then --baseline-steps timed steps) and gives the
// GPU's cached memory back afterwards. Failures are reported in `status`, never thrown.
BaselineResult run_baseline(const Options &o, int num_gpus);

} // namespace tb
