#include "engine/model.h"

#include <algorithm>

#include "engine/error.h"
#include "engine/log.h"

namespace rp {
namespace {

std::vector<at::Device> choose_devices(const ModelOptions &o) {
    const int gpus = visible_cuda_devices();
    bool cuda = o.device_kind == DeviceKind::Cuda || (o.device_kind == DeviceKind::Auto && gpus > 0);
    if (o.device_kind == DeviceKind::Cuda && gpus == 0)
        fail(ErrorKind::Cuda, "RP_DEVICE_CUDA was asked for but no CUDA GPU is visible");
    std::vector<at::Device> devices;
    if (cuda) {
        int n = o.num_devices > 0 ? o.num_devices : gpus;
        require(n <= gpus, std::to_string(n) + " GPUs were asked for but only " +
                               std::to_string(gpus) + " are visible");
        for (int i = 0; i < n; ++i)
            devices.emplace_back(at::kCUDA, static_cast<c10::DeviceIndex>(i));
    } else {
        int n = o.num_devices > 0 ? o.num_devices : 1;
        for (int i = 0; i < n; ++i)
            devices.emplace_back(at::kCPU);
    }
    return devices;
}

std::vector<Stage> choose_stages(const std::vector<std::unique_ptr<Layer>> &layers,
                                 const ModelOptions &o, size_t num_devices) {
    if (!o.stage_plan.empty())
        return plan_explicit(o.stage_plan, layers.size());
    std::vector<double> cost;
    for (const auto &l : layers)
        cost.push_back(l->cost_estimate());
    // Two stages per device keeps every device busy with the fused schedule while each stage
    // stays large enough to amortise its hand-offs.
    return plan_balanced(cost, std::max<size_t>(2, 2 * num_devices));
}

} // namespace

int visible_cuda_devices() { return at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0; }

Model::Model(std::vector<std::unique_ptr<Layer>> layers, const ModelOptions &o)
    : name_(o.name), seed_(o.seed), layers_(std::move(layers)),
      store_(layers_, o.model_dtype, o.seed,
             o.pin_mode != PinMode::Off && visible_cuda_devices() > 0 &&
                 o.device_kind != DeviceKind::Cpu),
      run_config_(o.run_config), pipeline_(choose_devices(o)) {
    stages_ = choose_stages(layers_, o, pipeline_.num_devices());
    if (o.pin_mode == PinMode::Register && has_cuda_devices())
        log(LogLevel::Warn, name_ + ": pin mode 'register' is not implemented yet; weights use "
                                    "pinned allocations ('alloc') instead");
    log(LogLevel::Info, name_ + ": " + std::to_string(layers_.size()) + " layers, " +
                            std::to_string(store_.size()) + " parameters tensors, " +
                            std::to_string(stages_.size()) + " stages on " +
                            std::to_string(pipeline_.num_devices()) +
                            (has_cuda_devices() ? " GPU(s)" : " CPU device(s)"));
}

Model::~Model() {
    try {
        runner_.wait_for(enqueued_);
    } catch (...) {
    }
}

ResolvedRunConfig Model::resolve(const RunConfig &call) const {
    ResolvedRunConfig r = ResolvedRunConfig::resolve(RunConfig::overlay(run_config_, call),
                                                     static_cast<int>(num_devices()));
    check_output_device(r.output_device);
    return r;
}

void Model::check_output_device(const at::Device &d) const {
    if (d.is_cuda())
        require(d.index() < visible_cuda_devices(),
                "output device cuda:" + std::to_string(d.index()) + " does not exist (" +
                    std::to_string(visible_cuda_devices()) + " GPUs visible)");
}

std::vector<at::Tensor> Model::forward(const std::vector<at::Tensor> &inputs,
                                       const RunConfig &call, bool *merge_output) {
    ResolvedRunConfig cfg = resolve(call);
    Microbatches mb = split_microbatches(inputs, at::Tensor(), cfg);
    for (const auto &mb_inputs : mb.inputs)
        check_shapes(layers_, store_, mb_inputs, at::Tensor(), nullptr);
    CallContext ctx{layers_, stages_, store_, mb};
    ctx.seed = seed_;
    ctx.training = false;
    ctx.output_device = cfg.output_device;
    ctx.grain = cfg.grain;
    pipeline_.run(ctx);
    *merge_output = cfg.merge_output;
    return ctx.outputs;
}

double Model::forward_backward(const std::vector<at::Tensor> &inputs, const at::Tensor &labels,
                               const Loss &loss, const RunConfig &call,
                               std::vector<at::Tensor> *outputs, bool *merge_output) {
    ResolvedRunConfig cfg = resolve(call);
    Microbatches mb = split_microbatches(inputs, labels, cfg);
    for (size_t m = 0; m < mb.inputs.size(); ++m)
        check_shapes(layers_, store_, mb.inputs[m], mb.labels[m], &loss);
    CallContext ctx{layers_, stages_, store_, mb};
    ctx.seed = seed_;
    ctx.call_index = training_calls_++;
    ctx.training = true;
    ctx.grain = cfg.grain;
    ctx.loss = &loss;
    ctx.output_device = cfg.output_device;
    ctx.keep_outputs = outputs != nullptr;
    pipeline_.run(ctx);
    // Only a call that finished commits its gradients: a failed call leaves no trace.
    for (const auto &grads : ctx.job_grads)
        store_.add_to_grads(grads);
    double total = 0.0;
    for (const at::Tensor &l : ctx.losses)
        total += l.item<double>();
    if (outputs)
        *outputs = std::move(ctx.outputs);
    if (merge_output)
        *merge_output = cfg.merge_output;
    return total;
}

void Model::rethrow_step_error() {
    if (std::exception_ptr e = runner_.take_error()) {
        try {
            std::rethrow_exception(e);
        } catch (const Error &err) {
            fail(err.kind() == ErrorKind::Callback ? ErrorKind::Callback : err.kind(),
                 std::string("an earlier optimizer step failed: ") + err.what());
        } catch (const std::exception &err) {
            fail(ErrorKind::Callback, std::string("an earlier optimizer step failed: ") + err.what());
        }
    }
}

void Model::publish_completed_step() {
    if (published_ == enqueued_)
        return;
    runner_.wait_for(enqueued_);
    store_.publish_staged();
    published_ = enqueued_;
}

void Model::step(std::function<void()> update, bool async) {
    // Make the previous step's weights the ones in use (staleness one), then hand this step the
    // gradients accumulated since.
    publish_completed_step();
    rethrow_step_error();
    store_.swap_grads();
    ++enqueued_;
    runner_.submit([this, update = std::move(update)] {
        // Whatever the update does, the staged copy and the gradient buffer are left ready for
        // the next step; the error (if any) is reported by the next waiting call.
        std::exception_ptr error;
        try {
            update();
        } catch (...) {
            error = std::current_exception();
        }
        store_.stage_from_master();
        store_.zero_step_grads();
        if (error)
            std::rethrow_exception(error);
    });
    if (!async) {
        publish_completed_step();
        rethrow_step_error();
    }
}

void Model::step_builtin(const OptimizerSettings &settings, bool async) {
    if (!builtin_)
        builtin_ = std::make_unique<BuiltinOptimizer>(settings.kind);
    else if (builtin_->kind() != settings.kind)
        fail(ErrorKind::State, std::string("the model already holds ") +
                                   (builtin_->kind() == OptimizerKind::AdamW ? "AdamW" : "SGD") +
                                   " state; use the same optimizer kind for every step");
    BuiltinOptimizer *opt = builtin_.get();
    step(
        [this, opt, settings] {
            std::vector<at::Tensor> params, grads;
            for (size_t i = 0; i < store_.size(); ++i) {
                params.push_back(store_.at(i).master);
                grads.push_back(store_.at(i).step_grad);
            }
            opt->step(params, grads, settings);
        },
        async);
}

void Model::synchronize() {
    runner_.wait_for(enqueued_);
    published_ = enqueued_;
    // Copy rather than swap: the user may have written master weights directly.
    store_.refresh_live_from_master();
    rethrow_step_error();
}

void Model::zero_grad() { store_.zero_grads(); }

void Model::load_master(const std::vector<at::Tensor> &values) {
    synchronize();
    for (size_t i = 0; i < store_.size(); ++i)
        store_.at(i).master.copy_(values[i]);
    store_.refresh_live_from_master();
    store_.zero_grads();
}

} // namespace rp
