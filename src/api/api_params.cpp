// Parameter access and weights on disk.
#include "api/api_guard.h"
#include "api/dlpack_bridge.h"
#include "api/handles.h"
#include "api/model_call.h"
#include "io/safetensors.h"

using namespace rp;

namespace {

const Param &param_of(const rp_model *model, size_t index) {
    require_arg(model && model->model, "model is NULL");
    const ParamStore &store = model->model->params();
    require(index < store.size(), "parameter index " + std::to_string(index) +
                                      " is out of range (the model has " +
                                      std::to_string(store.size()) + ")");
    return store.at(index);
}

} // namespace

extern "C" {

rp_status rp_param_count(size_t *out_count, const rp_model *model) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_count, "out_count is NULL");
        require_arg(model && model->model, "model is NULL");
        *out_count = model->model->params().size();
    });
}

rp_status rp_param_name(const char **out_name, const rp_model *model, size_t index) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_name, "out_name is NULL");
        *out_name = param_of(model, index).name.c_str();
    });
}

rp_status rp_param_find(size_t *out_index, const rp_model *model, const char *name) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_index, "out_index is NULL");
        require_arg(model && model->model, "model is NULL");
        require_arg(name, "name is NULL");
        int64_t i = model->model->params().find(name);
        require(i >= 0, std::string("no parameter named \"") + name + "\"");
        *out_index = static_cast<size_t>(i);
    });
}

rp_status rp_param_kind_of(int32_t *out_kind, const rp_model *model, size_t index) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_kind, "out_kind is NULL");
        switch (param_of(model, index).role) {
        case ParamRole::Trainable:
            *out_kind = RP_PARAM_TRAINABLE;
            break;
        case ParamRole::Frozen:
            *out_kind = RP_PARAM_FROZEN;
            break;
        case ParamRole::Buffer:
            *out_kind = RP_PARAM_BUFFER;
            break;
        }
    });
}

rp_status rp_param_shape(int64_t *out_shape, int32_t *out_ndim, int32_t capacity,
                         const rp_model *model, size_t index) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_ndim, "out_ndim is NULL");
        require_arg(capacity >= 0, "capacity is negative");
        require_arg(capacity == 0 || out_shape, "out_shape is NULL but capacity > 0");
        const at::Tensor &t = param_of(model, index).master;
        *out_ndim = static_cast<int32_t>(t.dim());
        for (int32_t d = 0; d < capacity && d < t.dim(); ++d)
            out_shape[d] = t.size(d);
    });
}

rp_status rp_param_master(DLManagedTensor **out_tensor, rp_model *model, size_t index) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_tensor, "out_tensor is NULL");
        *out_tensor = export_dlpack(param_of(model, index).master);
    });
}

rp_status rp_param_grad(DLManagedTensor **out_tensor, rp_model *model, size_t index) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_tensor, "out_tensor is NULL");
        const Param &p = param_of(model, index);
        require(p.trainable(), "parameter \"" + p.name + "\" is " +
                                   (p.role == ParamRole::Buffer ? "a buffer" : "frozen") +
                                   ": it has no gradient");
        // Inside a step callback the optimizer sees the gradients of its own step (Model says).
        *out_tensor = export_dlpack(model->model->exposed_grad(index));
    });
}

rp_status rp_param_grad_received(int32_t *out_received, const rp_model *model, size_t index) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(out_received, "out_received is NULL");
        // Frozen parameters and buffers never have one (rp_param_grad refuses them).
        *out_received =
            param_of(model, index).trainable() && hold.model().grad_received(index) ? 1 : 0;
    });
}

rp_status rp_model_save(rp_model *model, const char *path) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(model && model->model, "model is NULL");
        require_arg(path, "path is NULL");
        Model &m = *model->model;
        require(!m.on_optimizer_thread(), "rp_model_save may not be called from a step callback");
        m.synchronize();
        if (!m.writes_checkpoints())
            return; // data parallel: every rank holds the same weights; rank 0 writes them
        std::vector<NamedTensor> tensors;
        for (size_t i = 0; i < m.params().size(); ++i)
            tensors.push_back({m.params().at(i).name, m.params().at(i).live});
        write_safetensors(path, tensors, {{"format", "pt"}, {"producer", "roundpipe"}});
    });
}

rp_status rp_model_load(rp_model *model, const char *path) {
    return guard([&] {
        ModelCall hold(model);
        require_arg(model && model->model, "model is NULL");
        require_arg(path, "path is NULL");
        Model &m = *model->model;
        require(!m.on_optimizer_thread(), "rp_model_load may not be called from a step callback");
        // Names, shapes and dtypes are matched from the header before any tensor is read, and
        // tensors the model does not have are never read: a file may declare huge ones.
        auto wanted = [&](const std::string &name, at::ScalarType type, at::IntArrayRef shape) {
            int64_t i = m.params().find(name);
            if (i < 0)
                return false;
            const at::Tensor &master = m.params().at(i).master;
            if (shape != master.sizes())
                fail(ErrorKind::Io, std::string(path) + ": tensor \"" + name + "\" has shape " +
                                        c10::str(shape) + " but the model expects " +
                                        c10::str(master.sizes()));
            if (at::isFloatingType(type) != at::isFloatingType(master.scalar_type()))
                fail(ErrorKind::Io, std::string(path) + ": tensor \"" + name + "\" is " +
                                        c10::toString(type) + " but the model holds " +
                                        c10::toString(master.scalar_type()));
            return true;
        };
        std::vector<NamedTensor> file = read_safetensors(path, wanted);
        // Nothing changes unless every parameter loads.
        std::vector<at::Tensor> values(m.params().size());
        for (NamedTensor &nt : file)
            values[m.params().find(nt.name)] = nt.tensor;
        for (size_t i = 0; i < values.size(); ++i)
            if (!values[i].defined())
                fail(ErrorKind::Io,
                     std::string(path) + ": missing tensor \"" + m.params().at(i).name + "\"");
        m.load_master(values);
    });
}

} // extern "C"
