#include "engine/param_store.h"

#include "engine/cuda_memory.h"
#include "engine/error.h"
#include "engine/log.h"
#include "engine/seed.h"

namespace rp {
namespace {

at::Tensor initial_value(const ParamSpec &spec, at::Generator &gen) {
    at::Tensor t = at::empty(spec.shape, at::TensorOptions().dtype(at::kFloat));
    switch (spec.init) {
    case InitKind::Uniform:
        return t.uniform_(-spec.scale, spec.scale, gen);
    case InitKind::Normal:
        return t.normal_(0.0, spec.scale, gen);
    case InitKind::Ones:
        return t.fill_(1.0);
    case InitKind::Zeros:
        return t.zero_();
    }
    return t;
}

} // namespace

ParamStore::ParamStore(const std::vector<std::unique_ptr<Layer>> &layers,
                       at::ScalarType model_dtype, uint64_t seed, HostMemory host_memory)
    : by_layer_(layers.size()), model_dtype_(model_dtype) {
    at::TensorOptions host =
        at::TensorOptions().dtype(model_dtype).pinned_memory(host_memory == HostMemory::Pinned);
    for (size_t l = 0; l < layers.size(); ++l) {
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(init_seed(seed, l));
        for (const ParamSpec &spec : layers[l]->params()) {
            if (!spec.tied_to.empty()) {
                int64_t shared = find(spec.tied_to);
                require(shared >= 0, "layer " + std::to_string(l) + " (" + layers[l]->type() +
                                         "): tied parameter \"" + spec.tied_to +
                                         "\" does not exist in an earlier layer");
                require(params_[shared].master.sizes() == at::IntArrayRef(spec.shape),
                        "layer " + std::to_string(l) + " (" + layers[l]->type() +
                            "): tied parameter \"" + spec.tied_to + "\" has another shape");
                by_layer_[l].push_back(static_cast<size_t>(shared));
                continue;
            }
            Param p;
            p.name = std::to_string(l) + "." + spec.name;
            p.layer = l;
            p.master = initial_value(spec, gen);
            p.live = at::empty(spec.shape, host).copy_(p.master);
            p.staged = at::empty(spec.shape, host).copy_(p.master);
            p.grad = at::zeros_like(p.master);
            p.step_grad = at::zeros_like(p.master);
            by_layer_[l].push_back(params_.size());
            params_.push_back(std::move(p));
        }
    }
    if (host_memory == HostMemory::Registered) {
        // Page-lock the ordinary allocations in place: no power-of-two rounding of the pinned
        // allocator, so less host memory for very large models.
        int64_t failed = 0;
        for (Param &p : params_)
            for (at::Tensor *t : {&p.live, &p.staged}) {
                if (register_host_memory(t->data_ptr(), static_cast<int64_t>(t->nbytes())))
                    registered_.push_back(t->data_ptr());
                else
                    ++failed;
            }
        if (failed)
            log(LogLevel::Warn, "pin mode 'register': " + std::to_string(failed) +
                                    " weight buffers could not be page-locked and stay pageable");
    }
}

ParamStore::~ParamStore() {
    for (void *ptr : registered_)
        unregister_host_memory(ptr);
}

int64_t ParamStore::find(const std::string &name) const {
    for (size_t i = 0; i < params_.size(); ++i)
        if (params_[i].name == name)
            return static_cast<int64_t>(i);
    return -1;
}

void ParamStore::zero_grads() {
    for (Param &p : params_)
        p.grad.zero_();
}

void ParamStore::swap_grads() {
    for (Param &p : params_)
        std::swap(p.grad, p.step_grad);
}

void ParamStore::zero_step_grads() {
    for (Param &p : params_)
        p.step_grad.zero_();
}

void ParamStore::stage_from_master() {
    for (Param &p : params_)
        p.staged.copy_(p.master);
}

void ParamStore::publish_staged() {
    for (Param &p : params_)
        std::swap(p.live, p.staged);
}

void ParamStore::refresh_live_from_master() {
    for (Param &p : params_) {
        p.live.copy_(p.master);
        p.staged.copy_(p.master);
    }
}

} // namespace rp
