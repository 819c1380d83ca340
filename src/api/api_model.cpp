// Model lifetime, forward, fused forward + backward, optimizer steps.
#include "api/api_guard.h"
#include "api/dlpack_bridge.h"
#include "api/handles.h"
#include "engine/cuda_memory.h"
#include "layers/spec_parser.h"

using namespace rp;

namespace {

Model &model_of(rp_model *m) {
    require_arg(m && m->model, "model is NULL");
    return *m->model;
}

const Model &model_of(const rp_model *m) {
    require_arg(m && m->model, "model is NULL");
    return *m->model;
}

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

// Outputs must never alias the caller's borrowed inputs (a reshape-only model returns views).
rp_tensor_list *make_output_list(std::vector<at::Tensor> outputs, bool merge,
                                 const std::vector<at::Tensor> &inputs) {
    auto list = std::make_unique<rp_tensor_list>();
    if (merge)
        outputs = {merge_outputs(outputs)};
    for (at::Tensor &t : outputs) {
        for (const at::Tensor &in : inputs)
            if (t.storage().is_alias_of(in.storage())) {
                t = t.clone();
                break;
            }
        list->tensors.push_back(t);
    }
    return list.release();
}

Loss make_loss(const rp_loss *l) {
    Loss loss;
    if (!l)
        return loss;
    loss.kind = l->kind;
    loss.scale = l->scale;
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
                fail(ErrorKind::Callback, "loss callback returned no gradient for microbatch " +
                                              std::to_string(m));
            grad = adopt_dlpack(grad_dl, "loss callback gradient", /*allow_float64=*/true);
            return value;
        };
    }
    return loss;
}

// Token ids and labels of models with token layers are checked on the host: on a GPU an index
// out of range would be a device-side assertion that poisons the whole process.
void check_tokens(const rp_model *h, const std::vector<at::Tensor> &in, const at::Tensor &labels) {
    const at::Tensor &ids = in[0];
    if (h->input_vocab > 0 && !at::isFloatingType(ids.scalar_type()) && ids.numel() > 0) {
        at::Tensor bad = ids.lt(0).logical_or(ids.ge(h->input_vocab));
        if (bad.any().item<bool>())
            fail(ErrorKind::InvalidArgument,
                 "input 0 holds token id " +
                     std::to_string(ids.masked_select(bad)[0].item<int64_t>()) +
                     " outside the vocabulary [0, " + std::to_string(h->input_vocab) + ")");
    }
    if (h->label_vocab > 0 && labels.defined() && !at::isFloatingType(labels.scalar_type()) &&
        labels.numel() > 0) {
        at::Tensor bad =
            labels.ne(-100).logical_and(labels.lt(0).logical_or(labels.ge(h->label_vocab)));
        if (bad.any().item<bool>())
            fail(ErrorKind::InvalidArgument,
                 "labels hold " + std::to_string(labels.masked_select(bad)[0].item<int64_t>()) +
                     ", neither -100 (no target) nor a token id in [0, " +
                     std::to_string(h->label_vocab) + ")");
    }
}

// RP_LOSS_CAUSAL_LM: one normaliser for the whole call, the number of tokens with a target, so
// that the microbatch losses add up to the batch mean (docs/semantics.md).
void normalise_causal_lm(Loss &loss, const at::Tensor &labels, const at::Tensor &ids) {
    require(labels.defined(), "loss RP_LOSS_CAUSAL_LM needs labels (token ids, -100 for none)");
    require(!at::isFloatingType(labels.scalar_type()) && labels.dim() == 2,
            "loss RP_LOSS_CAUSAL_LM needs integer labels [batch, seq], got " +
                std::string(c10::toString(labels.scalar_type())) + " " + c10::str(labels.sizes()));
    require(labels.sizes() == ids.sizes(), "loss RP_LOSS_CAUSAL_LM needs labels of the shape of "
                                           "input 0 " + c10::str(ids.sizes()) + ", got " +
                                               c10::str(labels.sizes()));
    loss.scale /= static_cast<double>(std::max<int64_t>(1, causal_lm_target_count(labels)));
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
        auto handle = make_model_handle(parse_model_spec(spec_json), opts);
        *out_model = handle.release();
    });
}

void rp_model_destroy(rp_model *model) {
    // Destruction drains the optimizer thread and joins the workers; nothing may escape.
    try {
        delete model;
    } catch (...) {
    }
}

rp_status rp_model_num_layers(int32_t *out_count, const rp_model *model) {
    return guard([&] {
        require_arg(out_count, "out_count is NULL");
        *out_count = static_cast<int32_t>(model_of(model).num_layers());
    });
}

rp_status rp_model_num_stages(int32_t *out_count, const rp_model *model) {
    return guard([&] {
        require_arg(out_count, "out_count is NULL");
        *out_count = static_cast<int32_t>(model_of(model).num_stages());
    });
}

rp_status rp_model_num_devices(int32_t *out_count, const rp_model *model) {
    return guard([&] {
        require_arg(out_count, "out_count is NULL");
        *out_count = static_cast<int32_t>(model_of(model).num_devices());
    });
}

rp_status rp_model_step_count(int64_t *out_count, const rp_model *model) {
    return guard([&] {
        require_arg(out_count, "out_count is NULL");
        *out_count = model_of(model).steps_enqueued();
    });
}

rp_status rp_model_grad_scale(double *out_scale, int64_t *out_skipped_steps,
                              const rp_model *model) {
    return guard([&] {
        require_arg(out_scale && out_skipped_steps, "output pointer is NULL");
        const Model &m = model_of(model);
        *out_scale = m.grad_scale();
        *out_skipped_steps = m.skipped_steps();
    });
}

rp_status rp_model_gpu_memory_cap(int64_t *out_bytes, const rp_model *model) {
    return guard([&] {
        require_arg(out_bytes, "out_bytes is NULL");
        *out_bytes = model_of(model).gpu_memory_cap();
    });
}

rp_status rp_model_host_state_bytes(int64_t *out_bytes, int64_t *out_elements,
                                    const rp_model *model) {
    return guard([&] {
        require_arg(out_bytes && out_elements, "out_bytes or out_elements is NULL");
        *out_bytes = model_of(model).host_state_bytes(out_elements);
    });
}

rp_status rp_model_trace_json(const char **out_json, rp_model *model) {
    return guard([&] {
        require_arg(out_json, "out_json is NULL");
        Model &m = model_of(model);
        model->trace_json = m.trace_json();
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
        *out_tensor = export_dlpack(list->tensors[index]);
    });
}

void rp_tensor_list_destroy(rp_tensor_list *list) { delete list; }

rp_status rp_forward(rp_tensor_list **out_outputs, rp_model *model,
                     const DLManagedTensor *const *inputs, size_t n_inputs,
                     const rp_run_config *config) {
    return guard([&] {
        require_arg(out_outputs, "out_outputs is NULL");
        Model &m = model_of(model);
        require(!m.on_optimizer_thread(), "rp_forward may not be called from a step callback");
        std::vector<at::Tensor> in = borrow_inputs(inputs, n_inputs, input_gpus(m));
        check_tokens(model, in, at::Tensor());
        bool merge = true;
        std::vector<at::Tensor> outs = m.forward(in, config_of(config), &merge);
        *out_outputs = make_output_list(std::move(outs), merge, in);
    });
}

rp_status rp_forward_backward(double *out_loss, rp_tensor_list **out_outputs, rp_model *model,
                              const DLManagedTensor *const *inputs, size_t n_inputs,
                              const DLManagedTensor *labels, const rp_loss *loss,
                              const rp_run_config *config) {
    return guard([&] {
        Model &m = model_of(model);
        require(!m.on_optimizer_thread(),
                "rp_forward_backward may not be called from a step callback");
        std::vector<at::Tensor> in = borrow_inputs(inputs, n_inputs, input_gpus(m));
        at::Tensor lab = labels ? borrow_dlpack(labels, "labels", input_gpus(m)) : at::Tensor();
        check_tokens(model, in, lab);
        Loss l = make_loss(loss);
        if (l.kind == LossKind::CausalLm)
            normalise_causal_lm(l, lab, in[0]);
        std::vector<at::Tensor> outs;
        bool merge = true;
        double total =
            m.forward_backward(in, lab, l, config_of(config), out_outputs ? &outs : nullptr, &merge);
        if (out_outputs)
            *out_outputs = make_output_list(std::move(outs), merge, in);
        if (out_loss)
            *out_loss = total;
    });
}

rp_status rp_step(rp_model *model, const rp_optimizer *optimizer, int32_t is_async) {
    return guard([&] {
        Model &m = model_of(model);
        require_arg(optimizer, "optimizer is NULL");
        require(!m.on_optimizer_thread(), "rp_step may not be called from a step callback");
        m.step_builtin(optimizer->settings, is_async != 0);
    });
}

rp_status rp_step_callback(rp_model *model, rp_step_fn fn, void *user_data, int32_t is_async) {
    return guard([&] {
        Model &m = model_of(model);
        require_arg(fn, "step callback is NULL");
        require(!m.on_optimizer_thread(), "rp_step_callback may not be called from a step callback");
        m.step(
            // A callback updates every parameter at once: they become final when it returns.
            [model, fn, user_data](const ParamDone &) {
                int32_t rc = fn(model, user_data);
                if (rc != 0)
                    fail(ErrorKind::Callback, "step callback returned " + std::to_string(rc));
            },
            is_async != 0);
    });
}

rp_status rp_synchronize(rp_model *model) {
    return guard([&] {
        Model &m = model_of(model);
        require(!m.on_optimizer_thread(), "rp_synchronize may not be called from a step callback");
        m.synchronize();
    });
}

rp_status rp_zero_grad(rp_model *model) {
    return guard([&] {
        Model &m = model_of(model);
        require(!m.on_optimizer_thread(), "rp_zero_grad may not be called from a step callback");
        m.zero_grad();
    });
}

} // extern "C"
