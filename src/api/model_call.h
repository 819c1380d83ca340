// One exported call's hold on a model. The header allows one thread per model at a time; a call
// from a second thread while another runs finds the model busy and fails with RP_ERR_STATE
// instead of racing on the pipeline. Step callbacks run on the model's optimizer thread while
// the driving thread may be in a call (an asynchronous step overlaps the next call), so calls
// from that thread take no hold.
#pragma once
#include "api/handles.h"

namespace rp {

class ModelCall {
  public:
    // Throws InvalidArgument for NULL and State when another thread holds the model.
    explicit ModelCall(const rp_model *model) : model_(const_cast<rp_model *>(model)) {
        require(model_ && model_->model, "model is NULL");
        if (model_->model->on_optimizer_thread())
            return;
        if (model_->busy.exchange(true))
            fail(ErrorKind::State,
                 "the model is busy in another call (a model may be driven from one thread at a "
                 "time; serialise the calls or give each thread its own model)");
        held_ = true;
    }
    ~ModelCall() {
        if (held_)
            model_->busy.store(false);
    }
    ModelCall(const ModelCall &) = delete;
    ModelCall &operator=(const ModelCall &) = delete;

    Model &model() const { return *model_->model; }

  private:
    rp_model *model_;
    bool held_ = false;
};

} // namespace rp
