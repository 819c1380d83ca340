// Splitting a call's inputs and labels into microbatches, and merging outputs (upstream's
// rules: split along a dimension with tensor_split, replicate 0-d tensors, concatenate outputs
// along dim 0 and average 0-d outputs).
#pragma once
#include <vector>

#include <ATen/ATen.h>

#include "engine/run_config.h"

namespace rp {

struct Microbatches {
    std::vector<std::vector<at::Tensor>> inputs; // [microbatch][input]
    std::vector<at::Tensor> labels;              // [microbatch]; undefined tensors if no labels
};

// Throws InvalidArgument when a tensor has fewer rows than microbatches along its split dim.
Microbatches split_microbatches(const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                                const ResolvedRunConfig &config);

at::Tensor merge_outputs(const std::vector<at::Tensor> &outputs);

} // namespace rp
