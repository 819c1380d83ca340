// A weight upload kept from one call for the next. The weights of the first job a call runs on
// a device cross PCIe while nothing else can: at a call's start every device waits for them, and
// on several GPUs the tail's device then also waits behind them for its own. The devices idle
// through the ends of a call instead, so Pipeline::run uploads, during each device's last job,
// the weights the next call's first job on that device will read (standard mode: what the step
// running beside the call leaves, which the next rp_step publishes), and the next call uses them
// if they are still those weights.
#pragma once
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "engine/device_lane.h"

namespace rp {

struct CarriedWeights {
    std::vector<size_t> params;      // in the order of the upload
    std::vector<at::Tensor> sources; // the host tensors uploaded, one per parameter
    // The ParamStore::weights_version under which `sources` are the weights the devices read:
    // one more than at the upload when a step's result is still to be published.
    uint64_t version = 0;
    Transfer transfer; // the device copies (empty: nothing carried)
};

// Whether `carried` holds the weights a job reading `params` needs now, given each one's live
// tensor (`live`, in the same order) and the ParamStore::weights_version now: the same
// parameters, each live tensor the one uploaded, and no publish or refresh other than the one
// expected (a write outside a step, a second step, or none where one was expected all mean the
// values may differ).
bool carried_weights_match(const CarriedWeights &carried, const std::vector<size_t> &params,
                           const std::vector<at::Tensor> &live, uint64_t version);

} // namespace rp
