// Caller-defined layers: declarations, what their callbacks are lent, models built with them,
// and the tensor lists callbacks fill.
#include <cmath>

#include "api/api_guard.h"
#include "api/caller_bridge.h"
#include "api/dlpack_bridge.h"
#include "api/handles.h"
#include "engine/model.h"
#include "layers/spec_parser.h"

using namespace rp;

namespace {

void add_tensor(rp_layer_def *def, const char *name, const DLManagedTensor *initial,
                ParamRole role) {
    require_arg(def, "def is NULL");
    require_arg(name && *name, "name is NULL or empty");
    const std::string where = "layer \"" + def->type_name + "\", tensor \"" + name + "\"";
    for (const ParamSpec &spec : def->params)
        require(spec.name != name, where + ": the name is declared twice");
    at::Tensor value = borrow_dlpack(initial, where + ": initial value", visible_cuda_devices(),
                                     /*any_dtype=*/true);
    require(role != ParamRole::Trainable || at::isFloatingType(value.scalar_type()),
            where + ": a trainable parameter must be floating point, got " +
                std::string(c10::toString(value.scalar_type())) + " (declare it frozen)");
    ParamSpec spec(name, value.sizes().vec(), InitKind::Given);
    spec.role = role;
    spec.initial = value.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    def->params.push_back(std::move(spec));
}

} // namespace

extern "C" {

rp_status rp_tensor_list_create(rp_tensor_list **out_list) {
    return guard([&] {
        require_arg(out_list, "out_list is NULL");
        *out_list = new rp_tensor_list();
    });
}

rp_status rp_tensor_list_push(rp_tensor_list *list, DLManagedTensor *tensor) {
    // Ownership passes at entry: the deleter runs whatever happens below.
    if (!list) {
        if (tensor && tensor->deleter)
            tensor->deleter(tensor);
    }
    return guard([&] {
        require_arg(list, "list is NULL");
        if (!tensor) {
            list->tensors.emplace_back();
            return;
        }
        const std::string what = "tensor " + std::to_string(list->tensors.size());
        try {
            list->tensors.push_back(adopt_dlpack_any(tensor, what, visible_cuda_devices()));
        } catch (const Error &e) {
            if (list->push_error.empty())
                list->push_error = e.what();
            list->tensors.emplace_back(); // keeps later indices where the caller put them
            throw;
        }
    });
}

rp_status rp_layer_def_create(rp_layer_def **out_def, const char *type_name,
                              rp_layer_forward_fn forward, rp_layer_backward_fn backward,
                              rp_layer_release_fn release, void *user_data) {
    return guard([&] {
        require_arg(out_def, "out_def is NULL");
        require_arg(type_name && *type_name, "type_name is NULL or empty");
        require_arg(forward, "forward is NULL");
        auto def = std::make_unique<rp_layer_def>();
        def->type_name = type_name;
        def->forward = forward;
        def->backward = backward;
        def->release = release;
        def->user_data = user_data;
        *out_def = def.release();
    });
}

void rp_layer_def_destroy(rp_layer_def *def) { delete def; }

rp_status rp_layer_def_add_param(rp_layer_def *def, const char *name,
                                 const DLManagedTensor *initial, int32_t trainable) {
    return guard([&] {
        require_arg(trainable == 0 || trainable == 1, "trainable must be 0 or 1");
        add_tensor(def, name, initial, trainable ? ParamRole::Trainable : ParamRole::Frozen);
    });
}

rp_status rp_layer_def_add_tied_param(rp_layer_def *def, const char *name,
                                      const char *tied_to) {
    return guard([&] {
        require_arg(def, "def is NULL");
        require_arg(name && *name, "name is NULL or empty");
        require_arg(tied_to && *tied_to, "tied_to is NULL or empty");
        for (const ParamSpec &spec : def->params)
            require(spec.name != name, "layer \"" + def->type_name + "\", tensor \"" + name +
                                           "\": the name is declared twice");
        // The shape is the tied parameter's, known when the model is built.
        ParamSpec spec(name, {}, InitKind::Given, 0.0, tied_to);
        spec.shape_from_tie = true;
        def->params.push_back(std::move(spec));
    });
}

rp_status rp_layer_def_add_buffer(rp_layer_def *def, const char *name,
                                  const DLManagedTensor *initial) {
    return guard([&] { add_tensor(def, name, initial, ParamRole::Buffer); });
}

rp_status rp_layer_def_set_cost(rp_layer_def *def, double cost) {
    return guard([&] {
        require_arg(def, "def is NULL");
        require(std::isfinite(cost) && cost >= 0, "cost must be finite and >= 0");
        def->cost = cost;
    });
}

rp_status rp_layer_def_set_activation_bytes(rp_layer_def *def, double bytes_per_token) {
    return guard([&] {
        require_arg(def, "def is NULL");
        require(std::isfinite(bytes_per_token) && bytes_per_token >= 0,
                "activation bytes per token must be finite and >= 0");
        def->activation_bytes = bytes_per_token;
    });
}

rp_status rp_layer_call_info(int32_t *out_phase, int32_t *out_device_type, int32_t *out_device_id,
                             void **out_stream, uint64_t *out_seed, int32_t *out_microbatch,
                             int32_t *out_training, const rp_layer_call *call) {
    return guard([&] {
        require_arg(call, "call is NULL");
        const CallerCall &c = *call->call;
        if (out_phase)
            *out_phase = static_cast<int32_t>(c.phase); // Phase follows rp_layer_phase
        if (out_device_type)
            *out_device_type = c.device.is_cuda() ? kDLCUDA : kDLCPU;
        if (out_device_id)
            *out_device_id = c.device.is_cuda() ? c.device.index() : 0;
        if (out_stream)
            *out_stream = c.stream;
        if (out_seed)
            *out_seed = c.seed;
        if (out_microbatch)
            *out_microbatch = static_cast<int32_t>(c.microbatch);
        if (out_training)
            *out_training = c.training ? 1 : 0;
    });
}

rp_status rp_layer_call_tensors(const DLManagedTensor *const **out_params, size_t *out_n_params,
                                const DLManagedTensor *const **out_buffers,
                                size_t *out_n_buffers, const rp_layer_call *call) {
    return guard([&] {
        require_arg(call, "call is NULL");
        call->export_tensors();
        if (out_params)
            *out_params = call->params.data();
        if (out_n_params)
            *out_n_params = call->params.size();
        if (out_buffers)
            *out_buffers = call->buffers.data();
        if (out_n_buffers)
            *out_n_buffers = call->buffers.size();
    });
}

rp_status rp_model_create_with_layers(rp_model **out_model, const char *spec_json,
                                      const rp_layer_def *const *defs, size_t n_defs,
                                      const rp_model_options *options) {
    return guard([&] {
        require_arg(out_model, "out_model is NULL");
        require_arg(spec_json, "spec_json is NULL");
        require_arg(n_defs == 0 || defs, "defs is NULL but n_defs > 0");
        for (size_t k = 0; k < n_defs; ++k)
            require(defs[k] != nullptr, "defs[" + std::to_string(k) + "] is NULL");
        ModelOptions opts = options ? options->options : ModelOptions();
        auto layers = parse_model_spec(
            spec_json, [&](size_t k) { return make_caller_layer(*defs[k]); }, n_defs);
        refuse_lora_options(options, layers);
        auto handle = std::make_unique<rp_model>();
        handle->model = std::make_unique<Model>(std::move(layers), opts);
        *out_model = handle.release();
    });
}

} // extern "C"
