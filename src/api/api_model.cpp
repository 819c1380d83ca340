// Model lifetime, forward, fused forward + backward, optimizer steps.
#include <cmath>

#include "api/api_guard.h"
#include "api/caller_bridge.h"
#include "api/dlpack_bridge.h"
#include "api/handles.h"
#include "api/model_call.h"
#include "api/trace_json.h"
#include "base/log.h"
#include "engine/cuda_memory.h"
#include "layers/spec_parser.h"

using namespace rp;

namespace {

// Inputs may sit in GPU memory only when the model computes on GPUs.
int input_gpus(const Model &m) { return m.has_cuda_devices() ? visible_cuda_devices() : 0; }

std::vector<at::Tensor> borrow_inputs(const DLManagedTensor *const *inputs, size_t n, int gpus) {
    require(n >= 1 && n <= 64, "n_inputs must be in 1..64, got " + std::to_string(n));
    require_arg(inputs, "inputs is NULL");
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < n; ++i)
        out.push_back(borrow_dlpack(inputs[i], "input " + std::to_string(i), gpus));
    return out;
}

rp_tensor_list *make_output_list(std::vector<at::Tensor> outputs) {
    auto list = std::make_unique<rp_tensor_list>();
    list->tensors = std::move(outputs);
    return list.release();
}

Loss make_loss(const rp_loss *l) {
    Loss loss;
    if (!l)
        return loss;
    loss.kind = l->kind;
    loss.scale = l->scale;
    if (l->kind == LossKind::DeviceCallback)
        loss.device_callback = make_device_loss_callback(l->device_fn, l->user_data);
    if (l->kind == LossKind::Callback) {
        rp_loss_fn fn = l->fn;
        void *user_data = l->user_data;
        loss.callback = [fn, user_data](const at::Tensor &out, const at::Tensor &labels, int m,
                                        at::Tensor &grad) {
            DLManagedTensor *out_dl = export_dlpack(out);
            DLManagedTensor *label_dl = labels.defined() ? export_dlpack(labels) : nullptr;
            DLManagedTensor *grad_dl = nullptr;
            double value = 0.0;
            int32_t rc = fn(&value, &grad_dl, out_dl, label_dl, m, user_data);
            out_dl->deleter(out_dl);
            if (label_dl)
                label_dl->deleter(label_dl);
            if (rc != 0) {
                if (grad_dl && grad_dl->deleter)
                    grad_dl->deleter(grad_dl);
                fail(ErrorKind::Callback, "loss callback returned " + std::to_string(rc) +
                                              " for microbatch " + std::to_string(m));
            }
            if (!grad_dl)
                fail(ErrorKind::Callback,
                     "loss callback returned no gradient for microbatch " + std::to_string(m));
            grad = adopt_dlpack(grad_dl, "loss callback gradient", /*allow_float64=*/true);
            return value;
        };
    }
    return loss;
}

const RunConfig &config_of(const rp_run_config *c) {
    static const RunConfig empty;
    return c ? c->config : empty;
}

} // namespace

extern "C" {

rp_status rp_model_create(rp_model **out_model, const char *spec_json,
                          const rp_model_options *options) {
    return guard([&] {
        require_arg(out_model, "out_model is NULL");
        require_arg(spec_json, "spec_json is NULL");
        ModelOptions opts = options ? options->options : ModelOptions();
        auto layers = parse_model_spec(spec_json);
        refuse_lora_options(options, layers);
        auto handle = std::make_unique<rp_model>();
        handle->model = std::make_unique<Model>(std::move(layers), opts);
        *out_model = handle.release();
    });
}

void rp_model_destroy(rp_model *model) {
    // Destruction drains the optimizer thread and joins the workers; nothing may escape.
    try {
        if (model && model->model && (model->busy.load() || model->model->on_optimizer_thread())) {
            // Freeing the model under a running call would crash that call: leak it instead.
            log(LogLevel::Error, "rp_model_destroy: the model is in a call (on another thread, "
                                 "or this is its step callback); it was not destroyed");
            return;
        }
        delete model;
    } catch (...) {
    }
}

rp_status rp_model_num_layers(int32_t *out_count, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_count, "out_count is NULL");
        *out_count = static_cast<int32_t>(hold.model().num_layers());
    });
}

rp_status rp_model_num_stages(int32_t *out_count, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_count, "out_count is NULL");
        *out_count = static_cast<int32_t>(hold.model().num_stages());
    });
}

rp_status rp_model_num_devices(int32_t *out_count, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_count, "out_count is NULL");
        *out_count = static_cast<int32_t>(hold.model().num_devices());
    });
}

namespace {

// rp_model_stage_plan and rp_model_backward_stage_plan: one plan out to a caller's array.
void write_plan(const std::vector<int> &plan, int32_t *out_layers_per_stage,
                int32_t *out_num_stages, int32_t capacity) {
    require_arg(out_num_stages, "out_num_stages is NULL");
    require_arg(capacity >= 0, "capacity is negative");
    require_arg(capacity == 0 || out_layers_per_stage,
                "out_layers_per_stage is NULL but capacity > 0");
    for (int32_t s = 0; s < capacity && s < static_cast<int32_t>(plan.size()); ++s)
        out_layers_per_stage[s] = plan[s];
    *out_num_stages = static_cast<int32_t>(plan.size());
}

// rp_model_set_stage_plan and rp_model_set_backward_stage_plan: a caller's counts, checked.
std::vector<int> read_plan(const Model &m, const char *function, const int32_t *layers_per_stage,
                           size_t n) {
    require(!m.on_optimizer_thread(),
            std::string(function) + " may not be called from a step callback");
    require_arg(n == 0 || layers_per_stage, "layers_per_stage is NULL but n > 0");
    require(n <= m.num_layers(), "the plan has " + std::to_string(n) + " stages, the model " +
                                     std::to_string(m.num_layers()) + " layers");
    return std::vector<int>(layers_per_stage, layers_per_stage + n);
}

} // namespace

rp_status rp_model_stage_plan(int32_t *out_layers_per_stage, int32_t *out_num_stages,
                              int32_t capacity, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        write_plan(hold.model().stage_plan(), out_layers_per_stage, out_num_stages, capacity);
    });
}

rp_status rp_model_plan_stages(int32_t *out_layers_per_stage, int32_t *out_num_stages,
                               int32_t capacity, const rp_model *model, int64_t max_stage_bytes,
                               int32_t min_stages) {
    return guard([&] {
        ModelCall hold(model);
        require(max_stage_bytes >= 0, "max_stage_bytes must be >= 0 (0: no limit), got " +
                                          std::to_string(max_stage_bytes));
        require(min_stages >= 0, "min_stages must be >= 0, got " + std::to_string(min_stages));
        // Planning changes nothing, so write_plan may check the out-parameters after it.
        write_plan(hold.model().plan_stages(static_cast<double>(max_stage_bytes),
                                            static_cast<size_t>(min_stages)),
                   out_layers_per_stage, out_num_stages, capacity);
    });
}

rp_status rp_model_backward_stage_plan(int32_t *out_layers_per_stage, int32_t *out_num_stages,
                                       int32_t capacity, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        write_plan(hold.model().backward_stage_plan(), out_layers_per_stage, out_num_stages,
                   capacity);
    });
}

rp_status rp_model_set_stage_plan(rp_model *model, const int32_t *layers_per_stage, size_t n) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        m.set_stage_plan(read_plan(m, "rp_model_set_stage_plan", layers_per_stage, n));
    });
}

rp_status rp_model_set_backward_stage_plan(rp_model *model, const int32_t *layers_per_stage,
                                           size_t n) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        m.set_backward_stage_plan(
            read_plan(m, "rp_model_set_backward_stage_plan", layers_per_stage, n));
    });
}

rp_status rp_model_resolve_run_config(rp_run_config **out_config, const rp_model *model,
                                      const rp_run_config *call) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_config, "out_config is NULL");
        ResolvedRunConfig r = hold.model().resolve_run_config(config_of(call));
        auto handle = std::make_unique<rp_run_config>();
        handle->config = r.as_run_config();
        *out_config = handle.release();
    });
}

rp_status rp_model_step_count(int64_t *out_count, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_count, "out_count is NULL");
        *out_count = hold.model().steps_enqueued();
    });
}

rp_status rp_model_grad_scale(double *out_scale, int64_t *out_skipped_steps,
                              const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_scale && out_skipped_steps, "output pointer is NULL");
        const Model &m = hold.model();
        *out_scale = m.grad_scale();
        *out_skipped_steps = m.skipped_steps();
    });
}

rp_status rp_model_nonfinite_counts(int64_t *out_nonfinite_losses, int64_t *out_skipped_steps,
                                    const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_nonfinite_losses && out_skipped_steps, "output pointer is NULL");
        *out_nonfinite_losses = hold.model().nonfinite_losses();
        *out_skipped_steps = hold.model().skipped_steps();
    });
}

rp_status rp_model_set_grad_scaler(rp_model *model, double initial_scale, int32_t growth_interval) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require(!m.on_optimizer_thread(),
                "rp_model_set_grad_scaler may not be called from a step callback");
        require(std::isfinite(initial_scale) && initial_scale >= 0,
                "initial loss scale must be finite and >= 0 (0: off), got " +
                    std::to_string(initial_scale));
        require(growth_interval >= 1,
                "growth_interval must be >= 1, got " + std::to_string(growth_interval));
        m.set_grad_scaler(initial_scale, growth_interval);
    });
}

rp_status rp_model_set_skip_nonfinite_steps(rp_model *model, int32_t skip) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require(!m.on_optimizer_thread(),
                "rp_model_set_skip_nonfinite_steps may not be called from a step callback");
        require(skip == 0 || skip == 1,
                "skip_nonfinite_steps must be 0 or 1, got " + std::to_string(skip));
        m.set_skip_nonfinite_steps(skip == 1);
    });
}

rp_status rp_model_gpu_memory_cap(int64_t *out_bytes, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_bytes, "out_bytes is NULL");
        *out_bytes = hold.model().gpu_memory_cap();
    });
}

rp_status rp_model_data_parallel(int32_t *out_rank, int32_t *out_world_size,
                                 const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_rank && out_world_size, "out_rank or out_world_size is NULL");
        *out_rank = hold.model().rank();
        *out_world_size = hold.model().world_size();
    });
}

rp_status rp_model_host_state_bytes(int64_t *out_bytes, int64_t *out_elements,
                                    const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_bytes && out_elements, "out_bytes or out_elements is NULL");
        *out_bytes = hold.model().host_state_bytes(out_elements);
    });
}

rp_status rp_model_trace_json(const char **out_json, rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_json, "out_json is NULL");
        Model &m = hold.model();
        model->trace_json = chrome_trace_json(m.trace(), trace_device_names(m));
        *out_json = model->trace_json.c_str();
    });
}

rp_status rp_cuda_memory_stats(int64_t *out_allocated_bytes, int64_t *out_peak_bytes,
                               int32_t device) {
    return guard([&] {
        require_arg(out_allocated_bytes && out_peak_bytes, "output pointer is NULL");
        require(device >= 0 && device < visible_cuda_devices(),
                "GPU " + std::to_string(device) + " is not visible (" +
                    std::to_string(visible_cuda_devices()) + " GPUs)");
        GpuMemoryStats stats = gpu_memory_stats(device);
        *out_allocated_bytes = stats.allocated_bytes;
        *out_peak_bytes = stats.peak_allocated_bytes;
    });
}

rp_status rp_cuda_reset_peak_memory(int32_t device) {
    return guard([&] {
        require(device >= 0 && device < visible_cuda_devices(),
                "GPU " + std::to_string(device) + " is not visible (" +
                    std::to_string(visible_cuda_devices()) + " GPUs)");
        reset_gpu_peak_memory(device);
    });
}

rp_status rp_tensor_list_size(size_t *out_size, const rp_tensor_list *list) {
    return guard([&] {
        require_arg(out_size, "out_size is NULL");
        require_arg(list, "list is NULL");
        *out_size = list->tensors.size();
    });
}

rp_status rp_tensor_list_get(DLManagedTensor **out_tensor, const rp_tensor_list *list,
                             size_t index) {
    return guard([&] {
        require_arg(out_tensor, "out_tensor is NULL");
        require_arg(list, "list is NULL");
        require(index < list->tensors.size(), "index " + std::to_string(index) +
                                                  " is out of range (list holds " +
                                                  std::to_string(list->tensors.size()) + ")");
        const at::Tensor &t = list->tensors[index];
        *out_tensor = t.defined() ? export_dlpack(t) : nullptr; // NULL where NULL was pushed
    });
}

void rp_tensor_list_destroy(rp_tensor_list *list) { delete list; }

rp_status rp_forward(rp_tensor_list **out_outputs, rp_model *model,
                     const DLManagedTensor *const *inputs, size_t n_inputs,
                     const rp_run_config *config) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_outputs, "out_outputs is NULL");
        Model &m = hold.model();
        require(!m.on_optimizer_thread(), "rp_forward may not be called from a step callback");
        std::vector<at::Tensor> in = borrow_inputs(inputs, n_inputs, input_gpus(m));
        *out_outputs = make_output_list(m.forward(in, config_of(config)));
    });
}

rp_status rp_forward_train(rp_tensor_list **out_outputs, rp_model *model,
                           const DLManagedTensor *const *inputs, size_t n_inputs,
                           const rp_run_config *config) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_outputs, "out_outputs is NULL");
        Model &m = hold.model();
        require(!m.on_optimizer_thread(),
                "rp_forward_train may not be called from a step callback");
        std::vector<at::Tensor> in = borrow_inputs(inputs, n_inputs, input_gpus(m));
        *out_outputs = make_output_list(m.forward_train(in, config_of(config)));
    });
}

namespace {

std::vector<at::Tensor> borrow_output_grads(const Model &m, const DLManagedTensor *const *grads,
                                            size_t n) {
    require_arg(n == 0 || grads, "output_grads is NULL but n_grads > 0");
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < n; ++i)
        out.push_back(grads[i] ? borrow_dlpack(grads[i], "output gradient " + std::to_string(i),
                                               input_gpus(m))
                               : at::Tensor());
    return out;
}

} // namespace

rp_status rp_backward(rp_model *model, const DLManagedTensor *const *output_grads, size_t n_grads) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require(!m.on_optimizer_thread(), "rp_backward may not be called from a step callback");
        m.backward(borrow_output_grads(m, output_grads, n_grads));
    });
}

rp_status rp_backward_input_grads(rp_tensor_list **out_input_grads, rp_model *model,
                                  const DLManagedTensor *const *output_grads, size_t n_grads) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_input_grads, "out_input_grads is NULL");
        Model &m = hold.model();
        require(!m.on_optimizer_thread(),
                "rp_backward_input_grads may not be called from a step callback");
        std::vector<at::Tensor> input_grads;
        m.backward(borrow_output_grads(m, output_grads, n_grads), &input_grads);
        *out_input_grads = make_output_list(std::move(input_grads));
    });
}

rp_status rp_forward_backward(double *out_loss, rp_tensor_list **out_outputs, rp_model *model,
                              const DLManagedTensor *const *inputs, size_t n_inputs,
                              const DLManagedTensor *labels, const rp_loss *loss,
                              const rp_run_config *config) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require(!m.on_optimizer_thread(),
                "rp_forward_backward may not be called from a step callback");
        std::vector<at::Tensor> in = borrow_inputs(inputs, n_inputs, input_gpus(m));
        at::Tensor lab = labels ? borrow_dlpack(labels, "labels", input_gpus(m)) : at::Tensor();
        std::vector<at::Tensor> outs;
        double total = m.forward_backward(in, lab, make_loss(loss), config_of(config),
                                          out_outputs ? &outs : nullptr);
        if (out_outputs)
            *out_outputs = make_output_list(std::move(outs));
        if (out_loss)
            *out_loss = total;
    });
}

rp_status rp_step(rp_model *model, const rp_optimizer *optimizer, int32_t is_async) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require_arg(optimizer, "optimizer is NULL");
        require(!m.on_optimizer_thread(), "rp_step may not be called from a step callback");
        m.step_builtin(optimizer->settings, is_async != 0);
    });
}

rp_status rp_step_callback(rp_model *model, rp_step_fn fn, void *user_data, int32_t is_async) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require_arg(fn, "step callback is NULL");
        require(!m.on_optimizer_thread(),
                "rp_step_callback may not be called from a step callback");
        m.step(
            // A callback updates every parameter at once: they become final when it returns.
            [model, fn, user_data](const ParamDone &, const std::vector<uint8_t> &) {
                int32_t rc = fn(model, user_data);
                if (rc != 0)
                    fail(ErrorKind::Callback, "step callback returned " + std::to_string(rc));
            },
            is_async != 0);
    });
}

rp_status rp_model_set_step_in_call(rp_model *model, const rp_optimizer *optimizer) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require(!m.on_optimizer_thread(),
                "rp_model_set_step_in_call may not be called from a step callback");
        m.set_step_in_call(optimizer ? &optimizer->settings : nullptr);
    });
}

rp_status rp_model_step_in_call(int32_t *out_enabled, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_enabled, "out_enabled is NULL");
        *out_enabled = hold.model().step_in_call() ? 1 : 0;
    });
}

rp_status rp_synchronize(rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require(!m.on_optimizer_thread(), "rp_synchronize may not be called from a step callback");
        m.synchronize();
    });
}

rp_status rp_zero_grad(rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        Model &m = hold.model();
        require(!m.on_optimizer_thread(), "rp_zero_grad may not be called from a step callback");
        m.zero_grad();
    });
}

} // extern "C"
