#include "engine/carried_weights.h"

namespace rp {

bool carried_weights_match(const CarriedWeights &carried, const std::vector<size_t> &params,
                           const std::vector<at::Tensor> &live, uint64_t version) {
    if (carried.transfer.tensors.empty() || carried.params != params ||
        carried.sources.size() != params.size() || live.size() != params.size() ||
        carried.version != version)
        return false;
    for (size_t i = 0; i < params.size(); ++i)
        if (!carried.sources[i].is_same(live[i]))
            return false;
    return true;
}

} // namespace rp
