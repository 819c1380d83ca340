// The command line of train_bench (bench/RESULTS.md lists the flags).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shape.h"

namespace tb {

struct Options {
    std::string shape = "tiny";
    // Resolved by parse_options: the flag's value, else the shape's default.
    int64_t batch = -1, seq = -1, microbatches = -1;
    std::string grain = "stage";
    std::string dtype = "bf16";
    std::string optim_dtype = "f32";
    int steps = 8, warmup = 3;
    int fb_only_steps = 2, opt_steps = 2;
    std::string devices = "cuda";
    int num_devices = 0;
    bool baseline = true;
    int baseline_steps = -1, baseline_warmup = 2;
    int64_t baseline_microbatches = -1; // default: --microbatches
    std::string trace_file;
    std::string trace_alone_file; // the last call without a step in flight (isolated_phases)
    std::string plan = "auto"; // auto | comma-separated layers per stage
    // auto (the forward stages) | comma-separated layers per backward stage; needs --plan
    std::string backward_plan = "auto";
    double gpu_cap_gib = 0;
    std::string pin = "alloc";
    std::string host_memory = "standard";
    // Steps inside the training calls (rp_model_set_step_in_call; saving mode only).
    bool step_in_call = false;
    double lr = 1e-4, weight_decay = 0.01;
    uint64_t seed = 1;
    bool host_check = true;
    bool check = false;
    std::string label;
    // Data parallel from torchrun's environment ($RANK, $WORLD_SIZE, $MASTER_ADDR, $MASTER_PORT):
    // this process is one rank; tokens/s are this rank's.
    bool data_parallel = false;
    // LoRA adapters of this rank on --lora-targets (alpha = 2 * rank, PEFT's common choice);
    // every other parameter frozen. 0: a full fine-tune.
    int lora_rank = 0;
    std::string lora_targets = "all-linear";

    const Shape &model_shape() const; // the shape named by `shape` (checked by parse_options)
    int64_t tokens() const { return batch * seq; }
    bool on_gpu() const { return devices == "cuda"; }
    // Layers per stage of --plan / --backward-plan; empty for auto. Throw std::logic_error for
    // a bad list.
    std::vector<int32_t> plan_counts() const;
    std::vector<int32_t> backward_plan_counts() const;
};

// Parses and checks the command line; prints the usage and exits with 2 on a bad one.
Options parse_options(int argc, char **argv);

} // namespace tb
