#include "api/caller_bridge.h"

#include "api/dlpack_bridge.h"
#include "engine/model.h"

rp_layer_call::~rp_layer_call() {
    for (auto *list : {&params, &buffers})
        for (DLManagedTensor *t : *list)
            if (t && t->deleter)
                t->deleter(t);
}

void rp_layer_call::export_tensors() const {
    if (exported)
        return;
    exported = true;
    for (const at::Tensor &t : call->params)
        params.push_back(rp::export_dlpack(t));
    for (const at::Tensor &t : call->buffers)
        buffers.push_back(rp::export_dlpack(t));
}

namespace rp {
namespace {

// Borrowed DLPack views of engine tensors for the length of one callback; NULL for undefined.
class BorrowedList {
  public:
    explicit BorrowedList(const std::vector<at::Tensor> &tensors) {
        for (const at::Tensor &t : tensors)
            views_.push_back(t.defined() ? export_dlpack(t) : nullptr);
    }
    ~BorrowedList() {
        for (DLManagedTensor *t : views_)
            if (t && t->deleter)
                t->deleter(t);
    }
    BorrowedList(const BorrowedList &) = delete;
    BorrowedList &operator=(const BorrowedList &) = delete;
    const DLManagedTensor *const *data() const { return views_.data(); }
    size_t size() const { return views_.size(); }

  private:
    std::vector<DLManagedTensor *> views_;
};

int visible_gpus() { return visible_cuda_devices(); }

// The tensors a callback appended, after its status said success.
std::vector<at::Tensor> take_list(rp_tensor_list &list, const std::string &what) {
    if (!list.push_error.empty())
        fail(ErrorKind::Callback, what + ": " + list.push_error);
    return std::move(list.tensors);
}

void check_status(int32_t rc, const std::string &what) {
    if (rc != 0)
        fail(ErrorKind::Callback, what + " returned " + std::to_string(rc));
}

} // namespace

std::unique_ptr<Layer> make_caller_layer(const rp_layer_def &def) {
    CallerCallbacks cb;
    rp_layer_forward_fn forward = def.forward;
    rp_layer_backward_fn backward = def.backward;
    rp_layer_release_fn release = def.release;
    void *user_data = def.user_data;
    cb.forward = [forward, user_data](const CallerCall &call, const std::vector<at::Tensor> &inputs,
                                      void **context) {
        rp_layer_call handle;
        handle.call = &call;
        BorrowedList in(inputs);
        rp_tensor_list out;
        void *stored = nullptr;
        int32_t rc = forward(&out, &stored, &handle, in.data(), in.size(), user_data);
        if (call.phase != Phase::Forward)
            *context = stored; // released by the engine, also when rc says failure
        check_status(rc, "the forward callback");
        return take_list(out, "an output of the forward callback");
    };
    if (backward)
        cb.backward = [backward, user_data](const CallerCall &call, void *context,
                                            const std::vector<at::Tensor> &output_grads,
                                            std::vector<at::Tensor> &input_grads,
                                            std::vector<at::Tensor> &param_grads) {
            rp_layer_call handle;
            handle.call = &call;
            BorrowedList grads(output_grads);
            rp_tensor_list in_list, param_list;
            int32_t rc = backward(&in_list, &param_list, context, &handle, grads.data(),
                                  grads.size(), user_data);
            check_status(rc, "the backward callback");
            input_grads = take_list(in_list, "an input gradient of the backward callback");
            param_grads = take_list(param_list, "a parameter gradient of the backward callback");
        };
    if (release)
        cb.release = [release, user_data](void *context) { release(context, user_data); };
    return std::make_unique<CallerLayer>(def.type_name, def.params, std::move(cb), def.cost,
                                         def.activation_bytes);
}

DeviceLossCallback make_device_loss_callback(rp_device_loss_fn fn, void *user_data) {
    return [fn, user_data](const CallerCall &call, const std::vector<at::Tensor> &outputs,
                           const at::Tensor &labels, std::vector<at::Tensor> &grads) {
        rp_layer_call handle;
        handle.call = &call;
        BorrowedList outs(outputs);
        BorrowedList label(labels.defined() ? std::vector<at::Tensor>{labels}
                                            : std::vector<at::Tensor>{});
        rp_tensor_list grad_list;
        DLManagedTensor *loss_dl = nullptr;
        int32_t rc = fn(&loss_dl, &grad_list, &handle, outs.data(), outs.size(),
                        label.size() ? label.data()[0] : nullptr, user_data);
        if (rc != 0 && loss_dl && loss_dl->deleter)
            loss_dl->deleter(loss_dl);
        check_status(rc, "loss callback (microbatch " + std::to_string(call.microbatch) + ")");
        if (!loss_dl)
            fail(ErrorKind::Callback, "loss callback returned no loss for microbatch " +
                                          std::to_string(call.microbatch));
        at::Tensor loss = adopt_dlpack_any(loss_dl, "the loss from the loss callback", visible_gpus());
        grads = take_list(grad_list, "loss callback gradient");
        return loss;
    };
}

} // namespace rp
