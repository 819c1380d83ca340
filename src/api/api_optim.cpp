// Stateless optimizer updates over caller tensors (the moments and step counts are the
// caller's): the arithmetic of the engine's kernels for optimizers that live outside a model.
#include "api/api_guard.h"
#include "api/dlpack_bridge.h"
#include "optim/adam_apply.h"

using namespace rp;

namespace {

at::Tensor borrow_entry(const DLManagedTensor *const *array, size_t i, const char *role) {
    const std::string what = std::string(role) + " " + std::to_string(i);
    require(array[i] != nullptr, what + " is NULL");
    const DLDeviceType type = array[i]->dl_tensor.device.device_type;
    require(type == kDLCPU || type == kDLCUDAHost,
            what + " must be in host memory (kDLCPU or kDLCUDAHost), got device type " +
                std::to_string(static_cast<int>(type)));
    // Host memory only (gpus = 0); the dtype is checked by adam_apply, with its own message.
    return borrow_dlpack(array[i], what, /*gpus=*/0);
}

} // namespace

extern "C" {

rp_status rp_adam_apply(DLManagedTensor *const *params, const DLManagedTensor *const *grads,
                        DLManagedTensor *const *exp_avgs, DLManagedTensor *const *exp_avg_sqs,
                        const int64_t *steps, size_t n_tensors, double lr, double beta1,
                        double beta2, double eps, double weight_decay,
                        int32_t decoupled_weight_decay) {
    return guard([&] {
        require(n_tensors <= (size_t{1} << 24),
                "n_tensors is " + std::to_string(n_tensors) + " (at most 16777216)");
        require_arg(n_tensors == 0 || (params && grads && exp_avgs && exp_avg_sqs && steps),
                    "params, grads, exp_avgs, exp_avg_sqs or steps is NULL but n_tensors > 0");
        require(decoupled_weight_decay == 0 || decoupled_weight_decay == 1,
                "decoupled_weight_decay must be 0 or 1, got " +
                    std::to_string(decoupled_weight_decay));
        std::vector<AdamTensors> entries(n_tensors);
        for (size_t i = 0; i < n_tensors; ++i) {
            AdamTensors &e = entries[i];
            e.param = borrow_entry(params, i, "param");
            e.grad = borrow_entry(grads, i, "grad");
            e.exp_avg = borrow_entry(exp_avgs, i, "exp_avg");
            e.exp_avg_sq = borrow_entry(exp_avg_sqs, i, "exp_avg_sq");
            e.step = steps[i];
        }
        adam_apply(entries, AdamWHyper{lr, beta1, beta2, eps, weight_decay},
                   decoupled_weight_decay != 0);
    });
}

} // extern "C"
