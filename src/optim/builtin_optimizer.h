// State and update rule of a built-in optimizer (AdamW or SGD) over fp32 master weights.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/ATen.h>

namespace rp {

enum class OptimizerKind { AdamW, Sgd };

struct OptimizerSettings {
    OptimizerKind kind = OptimizerKind::AdamW;
    double lr = 1e-3;
    double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
    double weight_decay = 1e-2;
    double momentum = 0.0;
};

// Rows added in fp32 to a lent bf16 gradient (ParamStore::mark_rows_added): the gradient is the
// lent part plus `f32` on the rows `rows` marks (uint8 per row of dimension 0). Undefined `rows`:
// none.
struct AddedRows {
    at::Tensor f32, rows;
};

class BuiltinOptimizer {
  public:
    // `bf16_state`: moments (momentum) stored in bf16 with stochastic rounding (memory-saving
    // mode); fp32 otherwise.
    BuiltinOptimizer(OptimizerKind kind, bool bf16_state) : kind_(kind), bf16_state_(bf16_state) {}
    OptimizerKind kind() const { return kind_; }

    // Called as soon as parameter i is updated; `published`: its bf16 weight copy was refreshed
    // and its gradient zeroed in the same pass (see step).
    using ParamDone = std::function<void(size_t i, bool published)>;

    // Updates `params` (fp32, contiguous, CPU) in place from `grads` (fp32, or bf16 with
    // bf16 state), in order, calling `done` (if set) after each. `lives` (empty, or one per
    // parameter) names bf16 weight copies to refresh from the update while its data is in cache,
    // zeroing the gradient too (AdamW only; undefined entries are skipped; with fp32 state the
    // gradients must be fp32).
    // `has_grad` (empty: all) says which parameters received a gradient since the last step;
    // the others are left alone, their state and step count included (torch.optim skips a
    // parameter whose .grad is None), and reported done unpublished. `which` (empty: every
    // parameter) limits the call to those indices, in that order: a step taken in parts, each
    // as its parameters' gradients become final (Model's in-call steps); each parameter must be
    // in exactly one part of a step. `added_rows` (empty, or one per parameter): rows added in
    // fp32 to a lent bf16 gradient, read and zeroed by AdamW's update of a bf16 weight copy (the
    // standard mode's; the only place they occur). `lent` (empty: none; else one per
    // parameter): gradients that are downloads lent where they landed (in-call steps), which go
    // back to the staging pool as they are, so the update reads them without zeroing them; a
    // parameter's own gradient buffer is zeroed in the pass that reads it. Runs on the optimizer
    // thread; state is allocated at the first call.
    void step(const std::vector<at::Tensor> &params, const std::vector<at::Tensor> &grads,
              const OptimizerSettings &settings, const ParamDone &done = {},
              const std::vector<at::Tensor> &lives = {},
              const std::vector<uint8_t> &has_grad = {}, const std::vector<size_t> &which = {},
              const std::vector<AddedRows> &added_rows = {},
              const std::vector<uint8_t> &lent = {});
    // Tensor bytes of the optimizer state (0 before the first step). Any thread: the state is
    // allocated on the optimizer thread while the caller may ask.
    int64_t state_bytes() const { return state_bytes_; }

  private:
    OptimizerKind kind_;
    bool bf16_state_;
    std::vector<int64_t> steps_;  // per parameter: the steps that updated it (bias correction)
    std::vector<at::Tensor> first_moment_;  // AdamW exp_avg, SGD momentum buffer
    std::vector<at::Tensor> second_moment_; // AdamW exp_avg_sq
    std::vector<uint8_t> seeded_;           // SGD: the momentum buffer holds a gradient
    std::atomic<int64_t> state_bytes_{0};

    void count_state(); // after allocating state
    void step_adamw(const std::vector<at::Tensor> &params, const std::vector<at::Tensor> &grads,
                    const OptimizerSettings &s, const std::vector<at::Tensor> &lives,
                    const std::vector<bool> &update, const std::vector<size_t> &which,
                    const ParamDone &done, const std::vector<AddedRows> &added_rows,
                    const std::vector<uint8_t> &lent);
    void step_sgd(const std::vector<at::Tensor> &params, const std::vector<at::Tensor> &grads,
                  const OptimizerSettings &s, const std::vector<bool> &update,
                  const std::vector<size_t> &which, const ParamDone &done);
};

} // namespace rp
