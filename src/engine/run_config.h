// Run configuration (upstream's RoundPipeRunConfig): every field optional, so a per-call
// configuration overlays the model-level one field by field.
#pragma once
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

namespace rp {

enum class RecomputeGrain { Stage, Layer };

constexpr int kReplicate = -1; // split dim meaning "whole tensor to every microbatch"

// Returns pieces[microbatch][input].
using SplitFn = std::function<std::vector<std::vector<at::Tensor>>(
    const std::vector<at::Tensor> &inputs, int num_microbatch)>;

struct RunConfig {
    std::optional<int> num_microbatch;
    std::optional<RecomputeGrain> grain;
    std::optional<at::Device> output_device;
    std::map<int, int> input_split_dims;
    std::optional<int> label_split_dim;
    SplitFn split; // empty: unset
    std::optional<bool> merge_output;

    // Fields set in `over` win; input split dims merge key by key.
    static RunConfig overlay(const RunConfig &base, const RunConfig &over) {
        RunConfig r = base;
        if (over.num_microbatch)
            r.num_microbatch = over.num_microbatch;
        if (over.grain)
            r.grain = over.grain;
        if (over.output_device)
            r.output_device = over.output_device;
        for (const auto &kv : over.input_split_dims)
            r.input_split_dims[kv.first] = kv.second;
        if (over.label_split_dim)
            r.label_split_dim = over.label_split_dim;
        if (over.split)
            r.split = over.split;
        if (over.merge_output)
            r.merge_output = over.merge_output;
        return r;
    }
};

// A configuration with the built-in defaults filled in.
struct ResolvedRunConfig {
    int num_microbatch;
    RecomputeGrain grain;
    at::Device output_device;
    std::map<int, int> input_split_dims;
    int label_split_dim;
    SplitFn split;
    bool merge_output;

    static ResolvedRunConfig resolve(const RunConfig &c, int num_devices) {
        return {c.num_microbatch.value_or(num_devices + 1),
                c.grain.value_or(RecomputeGrain::Stage),
                c.output_device.value_or(at::Device(at::kCPU)),
                c.input_split_dims,
                c.label_split_dim.value_or(0),
                c.split,
                c.merge_output.value_or(true)};
    }

    // The same configuration with every field set.
    RunConfig as_run_config() const {
        RunConfig c;
        c.num_microbatch = num_microbatch;
        c.grain = grain;
        c.output_device = output_device;
        c.input_split_dims = input_split_dims;
        c.label_split_dim = label_split_dim;
        c.split = split;
        c.merge_output = merge_output;
        return c;
    }
};

} // namespace rp
