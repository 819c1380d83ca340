// Splitting a call's inputs and labels into microbatches, and merging outputs (upstream's
// rules: split along a dimension with tensor_split, replicate 0-d tensors, concatenate outputs
// along dim 0 and average 0-d outputs).
#pragma once
#include <string>
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

// One tensor's pieces: along `dim` as torch.tensor_split does, or `n` references to the whole
// tensor when it is 0-d or `dim` is kReplicate. Throws InvalidArgument naming `what` when `dim`
// is outside the tensor or there are fewer than `n` rows.
std::vector<at::Tensor> split_tensor(const at::Tensor &t, int dim, int n, const std::string &what);

at::Tensor merge_outputs(const std::vector<at::Tensor> &outputs);

} // namespace rp
