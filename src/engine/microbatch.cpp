#include "engine/microbatch.h"

#include <string>

#include "base/error.h"

namespace rp {

std::vector<at::Tensor> split_tensor(const at::Tensor &t, int dim, int n, const std::string &what) {
    if (t.dim() == 0 || dim == kReplicate)
        return std::vector<at::Tensor>(n, t);
    require(dim < t.dim(), what + " has " + std::to_string(t.dim()) +
                               " dimensions; cannot split along dimension " + std::to_string(dim));
    require(t.size(dim) >= n, what + " has " + std::to_string(t.size(dim)) +
                                  " entries along dimension " + std::to_string(dim) +
                                  ", fewer than num_microbatch = " + std::to_string(n) +
                                  "; lower num_microbatch or enlarge the batch");
    return at::tensor_split(t, n, dim);
}

Microbatches split_microbatches(const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                                const ResolvedRunConfig &config) {
    const int n = config.num_microbatch;
    Microbatches mb;
    mb.inputs.assign(n, {});
    if (config.split) {
        mb.inputs = config.split(inputs, n);
        require(static_cast<int>(mb.inputs.size()) == n,
                "split callback returned " + std::to_string(mb.inputs.size()) +
                    " microbatches, expected " + std::to_string(n));
    } else {
        for (size_t i = 0; i < inputs.size(); ++i) {
            auto it = config.input_split_dims.find(static_cast<int>(i));
            int dim = it == config.input_split_dims.end() ? 0 : it->second;
            std::vector<at::Tensor> pieces =
                split_tensor(inputs[i], dim, n, "input " + std::to_string(i));
            for (int m = 0; m < n; ++m)
                mb.inputs[m].push_back(pieces[m]);
        }
    }
    if (labels.defined())
        mb.labels = split_tensor(labels, config.label_split_dim, n, "labels");
    else
        mb.labels.assign(n, at::Tensor());
    return mb;
}

at::Tensor merge_outputs(const std::vector<at::Tensor> &outputs) {
    if (outputs.front().dim() == 0)
        return at::stack(outputs).mean(0);
    return at::cat(outputs, 0);
}

} // namespace rp
