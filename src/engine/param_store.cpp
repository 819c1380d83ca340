#include "engine/param_store.h"

#include <cstdio>

#include <ATen/Parallel.h>

#include "engine/cuda_memory.h"
#include "base/error.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "engine/seed.h"
#include "optim/bf16_convert.h"

namespace rp {
namespace {

void initialise(at::Tensor &t, const ParamSpec &spec, at::Generator &gen) {
    switch (spec.init) {
    case InitKind::Uniform:
        t.uniform_(-spec.scale, spec.scale, gen);
        return;
    case InitKind::Normal:
        t.normal_(0.0, spec.scale, gen);
        return;
    case InitKind::Ones:
        t.fill_(1.0);
        return;
    case InitKind::Zeros:
        t.zero_();
        return;
    case InitKind::Given:
        t.copy_(spec.initial);
        return;
    }
}

std::string gib(double bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / double(int64_t{1} << 30));
    return buf;
}

} // namespace

int64_t ParamStore::bytes_per_element(at::ScalarType model_dtype, HostMemoryMode mode) {
    const int64_t d = at::elementSize(model_dtype);
    if (mode == HostMemoryMode::Saving) // master, weight copy (none for fp32), one gradient,
        return model_dtype == at::kFloat ? 4 + 4 + 4 : 4 + d + 2 + 4; // bf16 moments
    return 4 + 2 * d + 4 + 4 + 8; // master, two weight copies, two gradients, fp32 moments
}

void ParamStore::check_fits_host(int64_t trainable, int64_t frozen, at::ScalarType model_dtype,
                                 HostMemoryMode mode, const std::string &what) {
    const HostMemoryHeadroom headroom = available_host_memory();
    const int64_t available = headroom.bytes;
    const int64_t per = bytes_per_element(model_dtype, mode);
    const int64_t held = static_cast<int64_t>(at::elementSize(model_dtype));
    int64_t needed = 0, frozen_bytes = 0;
    const bool overflow = trainable < 0 || frozen < 0 ||
                          __builtin_mul_overflow(trainable, per, &needed) ||
                          __builtin_mul_overflow(frozen, held, &frozen_bytes) ||
                          __builtin_add_overflow(needed, frozen_bytes, &needed);
    if (available < 0 && !overflow)
        return; // nothing says; let the allocator decide
    if (overflow || needed > available)
        fail(ErrorKind::OutOfMemory,
             what + " needs " + (overflow ? std::string("more bytes than an int64 counts")
                                          : gib(static_cast<double>(needed))) +
                 " of host memory for its parameter state (" + std::to_string(trainable) +
                 " trainable parameters x " + std::to_string(per) +
                 " bytes, optimizer state included" +
                 (frozen > 0 ? ", and " + std::to_string(frozen) + " frozen x " +
                                   std::to_string(held) + " bytes"
                             : std::string()) +
                 "), but the host has " + gib(static_cast<double>(available)) + " available (" +
                 headroom.source +
                 "); use the memory-saving host mode, a 16-bit model dtype, or a smaller model");
}

ParamStore::ParamStore(const std::vector<std::unique_ptr<Layer>> &layers,
                       at::ScalarType model_dtype, uint64_t seed, HostMemory host_memory,
                       HostMemoryMode mode)
    : by_layer_(layers.size()), model_dtype_(model_dtype), mode_(mode) {
    at::TensorOptions host =
        at::TensorOptions().dtype(model_dtype).pinned_memory(host_memory == HostMemory::Pinned);
    const bool saving = mode == HostMemoryMode::Saving;
    // Saving mode: gradients arrive in the model dtype; bf16 keeps fp16's small values (its
    // range is fp32's) at the same two bytes.
    const at::ScalarType grad_dtype =
        saving && model_dtype != at::kFloat ? at::kBFloat16 : at::kFloat;
    // Allocate in order (tied parameters refer to earlier ones), then initialise layer by layer
    // in parallel: each layer draws from its own generator, so the values do not depend on the
    // number of threads, and an 8B model starts in seconds instead of minutes.
    std::vector<std::vector<std::pair<size_t, const ParamSpec *>>> owned(layers.size());
    // Saving mode with fp32 weights: the devices read the master itself, so it is the buffer to
    // page-lock.
    const bool live_is_master = saving && model_dtype == at::kFloat;
    // Sizes come from outside (a spec, a config): an element count that overflows an int64 is
    // the caller's error, and the total must fit the host before anything is allocated.
    int64_t trainable = 0, frozen = 0;
    bool too_many = false;
    for (size_t l = 0; l < layers.size(); ++l) {
        const int64_t n = layers[l]->own_param_elements();
        if (n < 0)
            fail(ErrorKind::InvalidArgument, "layer " + std::to_string(l) + " (" +
                                                 layers[l]->type() +
                                                 "): its parameters have more elements than "
                                                 "an int64 can count");
        const int64_t t = layers[l]->own_param_elements(true);
        too_many = __builtin_add_overflow(trainable, t, &trainable) ||
                   __builtin_add_overflow(frozen, n - t, &frozen) || too_many;
    }
    check_fits_host(too_many ? -1 : trainable, too_many ? -1 : frozen, model_dtype, mode,
                    "the model");
    for (size_t l = 0; l < layers.size(); ++l) {
        for (const ParamSpec &spec : layers[l]->params()) {
            if (!spec.tied_to.empty()) {
                int64_t shared = find(spec.tied_to);
                require(shared >= 0, "layer " + std::to_string(l) + " (" + layers[l]->type() +
                                         "): tied parameter \"" + spec.tied_to +
                                         "\" does not exist in an earlier layer");
                require(spec.shape_from_tie ||
                            params_[shared].master.sizes() == at::IntArrayRef(spec.shape),
                        "layer " + std::to_string(l) + " (" + layers[l]->type() +
                            "): tied parameter \"" + spec.tied_to + "\" has another shape");
                by_layer_[l].push_back(static_cast<size_t>(shared));
                continue;
            }
            Param p;
            p.name = std::to_string(l) + "." + spec.name;
            p.layer = l;
            p.role = spec.role;
            if (!p.trainable()) {
                // Held once: floating values in the model dtype (a frozen bf16 weight costs 2
                // bytes), others (counters, indices) as given.
                const bool floating =
                    !spec.initial.defined() || at::isFloatingType(spec.initial.scalar_type());
                p.master = at::empty(spec.shape, host.dtype(floating ? model_dtype
                                                                     : spec.initial.scalar_type()));
                p.live = p.master;
                owned[l].emplace_back(params_.size(), &spec);
                by_layer_[l].push_back(params_.size());
                params_.push_back(std::move(p));
                continue;
            }
            p.master = at::empty(spec.shape,
                                 live_is_master ? host : at::TensorOptions().dtype(at::kFloat));
            p.live = live_is_master ? p.master : at::empty(spec.shape, host);
            if (!saving) {
                p.staged = at::empty(spec.shape, host);
                p.step_grad = at::zeros(spec.shape, at::TensorOptions().dtype(at::kFloat));
            }
            p.grad = at::zeros(spec.shape, at::TensorOptions().dtype(grad_dtype));
            owned[l].emplace_back(params_.size(), &spec);
            by_layer_[l].push_back(params_.size());
            params_.push_back(std::move(p));
        }
    }
    at::parallel_for(0, static_cast<int64_t>(layers.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t l = begin; l < end; ++l) {
            at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(init_seed(seed, l));
            for (const auto &[index, spec] : owned[l]) {
                Param &p = params_[index];
                initialise(p.master, *spec, gen);
                copy_master_to_weights(p);
            }
        }
    });
    if (host_memory == HostMemory::Registered) {
        // Page-lock the ordinary allocations in place: no power-of-two rounding of the pinned
        // allocator, so less host memory for very large models.
        int64_t failed = 0;
        for (Param &p : params_)
            for (at::Tensor *t : {&p.live, &p.staged}) {
                if (!t->defined())
                    continue;
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

namespace {

// Drops a lent gradient, counting its bytes back.
void release(at::Tensor &lent, std::atomic<int64_t> &lent_bytes) {
    if (!lent.defined())
        return;
    lent_bytes -= static_cast<int64_t>(lent.nbytes());
    lent = at::Tensor();
}

const uint16_t *bf16_bits(const at::Tensor &t) {
    return reinterpret_cast<const uint16_t *>(t.data_ptr());
}

// grad += the lent gradient, widened (exact), and the lent gradient and its row marks released:
// a copy where the buffer is zero, an add (grad + lent, the order the step's kernel adds in) on
// the rows added into it meanwhile (mark_rows_added).
void widen_lent(at::Tensor &grad, at::Tensor &lent, at::Tensor &added_rows,
                std::atomic<int64_t> &lent_bytes) {
    if (!lent.defined())
        return;
    if (!added_rows.defined()) {
        grad.copy_(lent);
    } else {
        const int64_t rows = grad.size(0), width = grad.numel() / rows;
        const uint8_t *added = added_rows.data_ptr<uint8_t>();
        const uint16_t *in = bf16_bits(lent);
        float *out = grad.data_ptr<float>();
        at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r)
                if (added[r])
                    add_widened_bf16(in + r * width, out + r * width, width, 1.0f);
                else
                    widen_bf16(in + r * width, out + r * width, width);
        });
        added_rows = at::Tensor();
    }
    release(lent, lent_bytes);
}

} // namespace

void ParamStore::zero_grads() {
    for (size_t i = 0; i < params_.size(); ++i)
        zero_grad(i);
}

void ParamStore::zero_grad(size_t i) {
    Param &p = params_[i];
    if (p.grad.defined())
        p.grad.zero_();
    release(p.landed, lent_bytes_);
    p.landed_rows = at::Tensor();
}

void ParamStore::swap_grads() {
    for (Param &p : params_) {
        std::swap(p.grad, p.step_grad);
        std::swap(p.landed, p.step_landed);
        std::swap(p.landed_rows, p.step_landed_rows);
    }
}

void ParamStore::lend_grad(size_t i, at::Tensor download) {
    Param &p = params_[i];
    require(!saving() && !p.landed.defined() && !p.landed_rows.defined() &&
                download.scalar_type() == at::kBFloat16 &&
                download.sizes() == p.grad.sizes() && download.is_contiguous(),
            "lend_grad: not a whole bf16 gradient of a standard-mode parameter");
    lent_bytes_ += static_cast<int64_t>(download.nbytes());
    p.landed = std::move(download);
}

void ParamStore::materialize_grad(size_t i) {
    Param &p = params_[i];
    widen_lent(p.grad, p.landed, p.landed_rows, lent_bytes_);
}

void ParamStore::materialize_step_grad(size_t i) {
    Param &p = params_[i];
    widen_lent(p.step_grad, p.step_landed, p.step_landed_rows, lent_bytes_);
}

bool ParamStore::materialize_grad_adding(size_t i, const at::Tensor &plus) {
    Param &p = params_[i];
    if (!p.landed.defined() || p.landed_rows.defined() || plus.scalar_type() != at::kBFloat16 ||
        !plus.is_contiguous() || plus.sizes() != p.grad.sizes())
        return false;
    const uint16_t *a = bf16_bits(p.landed), *b = bf16_bits(plus);
    float *out = p.grad.data_ptr<float>();
    at::parallel_for(0, p.grad.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
        sum_widened_bf16(a + begin, b + begin, out + begin, end - begin);
    });
    release(p.landed, lent_bytes_);
    return true;
}

void ParamStore::mark_rows_added(size_t i, const at::Tensor &rows) {
    Param &p = params_[i];
    if (!p.landed.defined())
        return;
    const int64_t num_rows = p.grad.size(0);
    if (!p.landed_rows.defined())
        p.landed_rows = at::zeros({num_rows}, at::kByte);
    uint8_t *added = p.landed_rows.data_ptr<uint8_t>();
    const at::Tensor index = rows.to(at::kLong).contiguous().view(-1);
    const int64_t *row = index.data_ptr<int64_t>();
    for (int64_t k = 0; k < index.numel(); ++k) {
        require(row[k] >= 0 && row[k] < num_rows, "mark_rows_added: row out of range");
        added[row[k]] = 1;
    }
}

void ParamStore::release_step_grads() {
    for (Param &p : params_) {
        release(p.step_landed, lent_bytes_);
        p.step_landed_rows = at::Tensor();
    }
}

void ParamStore::finish_standard_step(size_t i) {
    Param &p = params_[i];
    if (p.staged.defined())
        p.staged.copy_(p.master);
    if (p.step_grad.defined())
        p.step_grad.zero_();
    release(p.step_landed, lent_bytes_);
    p.step_landed_rows = at::Tensor();
}

void ParamStore::publish_staged() {
    ++weights_version_;
    for (Param &p : params_)
        if (p.staged.defined())
            std::swap(p.live, p.staged);
}

void ParamStore::copy_master_to_weights(Param &p) {
    if (!p.live.is_same(p.master))
        p.live.copy_(p.master);
    if (p.staged.defined())
        p.staged.copy_(p.master);
}

void ParamStore::finish_step(size_t i) {
    copy_master_to_weights(params_[i]); // saving mode: no staged copy
    if (params_[i].grad.defined())
        params_[i].grad.zero_();
}

void ParamStore::refresh_live_from_master() {
    ++weights_version_;
    for (Param &p : params_)
        copy_master_to_weights(p);
}

int64_t ParamStore::state_bytes(int64_t *elements) const {
    int64_t bytes = 0, count = 0;
    for (const Param &p : params_) {
        count += p.master.numel();
        for (const at::Tensor *t : {&p.master, &p.live, &p.staged, &p.grad, &p.step_grad})
            if (t->defined() && (t == &p.master || !t->is_same(p.master)))
                bytes += static_cast<int64_t>(t->nbytes());
    }
    *elements = count;
    return bytes;
}

} // namespace rp
