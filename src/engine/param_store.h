// Host parameter store. Per parameter:
//   master    fp32 weights the optimizer updates;
//   live      model-dtype weights the devices compute with;
//   staged    model-dtype copy of the master written by the optimizer thread after each step,
//             swapped with `live` when the step is published (double buffer: an async step never
//             writes weights a running pipeline reads);
//   grad      gradient accumulated by forward_backward since the last step;
//   step_grad gradient the running step consumes (swapped with `grad` at rp_step);
//   landed, step_landed
//             standard mode, bf16 models: the gradient since the last step, where its download
//             landed (bf16), lent instead of widened into `grad` (see lend_grad), and the one the
//             running step consumes;
//   landed_rows, step_landed_rows
//             rows added into `grad` while the gradient was lent (mark_rows_added), one byte per
//             row: the gradient is `landed` widened, plus `grad` on those rows (zero elsewhere).
//
// Memory-saving mode (docs/semantics.md) keeps one buffer of each kind: no `staged` (steps are
// ordered against calls by a StepGate instead), no `step_grad` (the step consumes `grad` before
// the next call's gradients for that parameter can arrive), `grad` in bf16 for 16-bit models, and
// `live` is the master itself for fp32 models.
#pragma once
#include <atomic>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "engine/layer.h"

namespace rp {

enum class HostMemory {
    Pageable,   // ordinary allocations
    Pinned,     // page-locked allocations (fastest uploads)
    Registered  // ordinary allocations page-locked in place with cudaHostRegister
};

enum class HostMemoryMode { Standard, Saving };

struct Param {
    std::string name;
    size_t layer;
    ParamRole role = ParamRole::Trainable;
    // Frozen parameters and buffers: `master` is the held value and `live` the same tensor;
    // `staged`, `grad` and `step_grad` stay undefined.
    at::Tensor master, live, staged, grad, step_grad, landed, step_landed;
    at::Tensor landed_rows, step_landed_rows; // uint8 [rows], undefined while no row was moved
    bool trainable() const { return role == ParamRole::Trainable; }
};

class ParamStore {
  public:
    // Initialises every parameter from `seed` (docs/semantics.md). `host_memory` says how the
    // model-dtype copies the devices read are page-locked (only meaningful with CUDA devices).
    ParamStore(const std::vector<std::unique_ptr<Layer>> &layers, at::ScalarType model_dtype,
               uint64_t seed, HostMemory host_memory, HostMemoryMode mode);
    ~ParamStore();
    ParamStore(const ParamStore &) = delete;

    // Host bytes per parameter element in this layout, built-in AdamW state included (the most
    // any built-in optimizer allocates at its first step).
    static int64_t bytes_per_element(at::ScalarType model_dtype, HostMemoryMode mode);
    // Throws OutOfMemory, with the figures, when `trainable` parameters in this layout plus
    // `frozen` ones held in the model dtype (frozen parameters and buffers) need more host memory
    // than the host has available; `what` names the model in the message. Checked before
    // anything is allocated. A negative count means one that overflowed an int64.
    static void check_fits_host(int64_t trainable, int64_t frozen, at::ScalarType model_dtype,
                                HostMemoryMode mode, const std::string &what);
    ParamStore &operator=(const ParamStore &) = delete;

    size_t size() const { return params_.size(); }
    Param &at(size_t i) { return params_[i]; }
    const Param &at(size_t i) const { return params_[i]; }
    const std::vector<size_t> &layer_params(size_t layer) const { return by_layer_[layer]; }
    at::ScalarType model_dtype() const { return model_dtype_; }
    bool saving() const { return mode_ == HostMemoryMode::Saving; }
    int64_t find(const std::string &name) const; // -1 when absent
    // The gradient an optimizer step reads: step_grad, or grad in memory-saving mode (fp32 or
    // the model dtype; in the standard mode a lent one is not in it: materialize_step_grad).
    const at::Tensor &step_grad(size_t i) const {
        return saving() ? params_[i].grad : params_[i].step_grad;
    }
    // Tensor bytes of master, weight copies and gradients; `elements` receives the parameter
    // count.
    int64_t state_bytes(int64_t *elements) const;

    void zero_grads();          // lent gradients included
    void zero_grad(size_t i);   // parameter i's, lent included
    // Standard mode only: the double buffers of weights and gradients.
    void swap_grads();            // grad <-> step_grad (and landed <-> step_landed); step_grad
                                  // must be zero and nothing lent to the step
    // Standard mode, bf16 models: parameter i's whole gradient since the last step is
    // `download` (bf16, the same shape), lent where it landed instead of widened into `grad`,
    // which must be zero and stays so: the built-in AdamW reads it there (half the bytes, and
    // no widening pass on the gradient thread). Whoever needs the fp32 gradient first calls
    // materialize_grad / materialize_step_grad.
    void lend_grad(size_t i, at::Tensor download);
    bool grad_lent(size_t i) const { return params_[i].landed.defined(); }
    void materialize_grad(size_t i);      // grad = the lent gradient, widened; released
    void materialize_step_grad(size_t i); // the same for the gradient the step consumes
    // Before rows of a gradient (`rows`: indices into dimension 0, repeats allowed) add into
    // `grad` while a part of the gradient is lent: marks them (landed_rows), so the gradient is
    // `landed` + `grad` on those rows and `landed` elsewhere. A tied embedding's rows then cost
    // their own rows, not a widening of the whole LM-head part. No-op when nothing is lent.
    void mark_rows_added(size_t i, const at::Tensor &rows);
    // A second whole contribution `plus` (bf16, the gradient's shape, contiguous) to a lent
    // gradient without added rows: grad = lent + plus, both widened, in one pass (the bits of
    // widening the lent part and then adding), and the lent part released. False, with nothing
    // done, where that does not apply.
    bool materialize_grad_adding(size_t i, const at::Tensor &plus);
    void release_step_grads();            // after a step: its lent gradients go back
    // Bytes of downloads lent and not yet given back (pinned staging memory, bounded by the
    // lender): those above, and, for in-call steps, those handed straight to the optimizer
    // thread, which count_lent adds (positive) and gives back (negative).
    int64_t lent_bytes() const { return lent_bytes_.load(); }
    void count_lent(int64_t bytes) { lent_bytes_ += bytes; }
    // Optimizer thread, after a step left parameter i alone (or updated it without refreshing
    // its copy): staged = master, step_grad = 0.
    void finish_standard_step(size_t i);
    void publish_staged();        // live <-> staged
    // Memory-saving mode, optimizer thread: parameter i's live copy = master, gradient = 0.
    void finish_step(size_t i);
    void refresh_live_from_master(); // live (and staged) = master (nothing in flight)
    // Counts the changes to the weights the devices read made outside an optimizer step: a
    // publish (which live tensor is which) and a refresh from the masters (their values). A
    // weight upload kept for a later call (CarriedWeights) is still good only while this
    // count is the one it expects.
    uint64_t weights_version() const { return weights_version_.load(); }

  private:
    // live and staged = master, where they are buffers of their own.
    static void copy_master_to_weights(Param &p);

    std::vector<Param> params_;
    std::vector<std::vector<size_t>> by_layer_;
    at::ScalarType model_dtype_;
    HostMemoryMode mode_;
    std::vector<void *> registered_; // host ranges to unregister at destruction
    std::atomic<int64_t> lent_bytes_{0}; // landed and step_landed (written by two threads)
    std::atomic<uint64_t> weights_version_{0};
};

} // namespace rp
