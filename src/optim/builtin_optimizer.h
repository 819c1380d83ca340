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

// What one BuiltinOptimizer::step updates, each array indexed by parameter.
struct StepArrays {
    // fp32, contiguous, CPU; undefined entries (frozen parameters, buffers) are skipped.
    std::vector<at::Tensor> params;
    // fp32, or bf16 with bf16 state.
    std::vector<at::Tensor> grads;
    // Empty, or one per parameter: bf16 weight copies to refresh from the update while its data
    // is in cache, zeroing the gradient too (AdamW, and SGD with bf16 state; undefined entries
    // are skipped; with fp32 state the gradients must be fp32).
    std::vector<at::Tensor> lives;
    // Empty: all. Which parameters received a gradient since the last step; the others are left
    // alone, their state and step count included (torch.optim skips a parameter whose .grad is
    // None), and reported done unpublished.
    std::vector<uint8_t> has_grad;
    // Empty: every parameter. Limits the call to those indices, in that order: a step taken in
    // parts, each as its parameters' gradients become final (Model's in-call steps); each
    // parameter must be in exactly one part of a step.
    std::vector<size_t> which;
    // Empty, or one per parameter: rows added in fp32 to a lent bf16 gradient, read and zeroed
    // by AdamW's update of a bf16 weight copy (the standard mode's; the only place they occur).
    std::vector<AddedRows> added_rows;
    // Empty: none; else one per parameter: gradients that are downloads lent where they landed
    // (in-call steps), which go back to the staging pool as they are, so the update reads them
    // without zeroing them; a parameter's own gradient buffer is zeroed in the pass that reads
    // it.
    std::vector<uint8_t> lent;
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

    // Updates `a.params` in place from `a.grads`, in order, calling `done` (if set) after each
    // (StepArrays says what each array means). Runs on the optimizer thread; state is allocated
    // at the first call.
    void step(const StepArrays &a, const OptimizerSettings &settings, const ParamDone &done = {});
    // A table's update in two parts (memory-saving AdamW with a bf16 weight copy only): if the
    // next step() updates parameter `param` ([rows, width]), it updates only the rows `rows_now`
    // marks (uint8 per row, 1: now), reading the gradient there, and does not report the
    // parameter done. The other rows must have a zero gradient (an embedding's rows no token of
    // the call used): serve_deferred_rows and finish_deferred_rows update them later with that
    // step's count and hyperparameters, each element bit for bit what the whole update gives it
    // (adamw_update_bf16_state_rows). Anything else (SGD, fp32 state, no weight copy, no
    // gradient) updates the whole parameter as usual; the next step() drops the split either
    // way. At most one split update with rows left at a time.
    void split_next_update(size_t param, at::Tensor rows_now);
    // Whether a split update has rows left (between it and finish_deferred_rows).
    bool has_deferred_rows() const { return deferred_.param != kNone; }
    // Updates the deferred rows `needed` marks (uint8 per row), so that a reader of only those
    // rows may go ahead; they are no longer deferred.
    void serve_deferred_rows(const at::Tensor &needed);
    // Updates the deferred rows among the next `max_rows` rows (<= 0: all the rest), in row
    // order, so that a caller can serve needed rows in between; once the last row is passed,
    // reports the parameter done (published). True once no row is deferred.
    bool finish_deferred_rows(const ParamDone &done, int64_t max_rows = 0);
    // Tensor bytes of the optimizer state (0 before the first step). Any thread: the state is
    // allocated on the optimizer thread while the caller may ask.
    int64_t state_bytes() const { return state_bytes_; }

  private:
    static constexpr size_t kNone = static_cast<size_t>(-1);
    // A split update's rows still to do: `rows_done` (uint8 per row, 1: updated), and what the
    // update they belong to used.
    struct DeferredRows {
        size_t param = kNone;
        at::Tensor master, live, rows_done;
        OptimizerSettings settings;
        int64_t step = 0;
        int64_t next_row = 0; // finish_deferred_rows's progress
    };
    OptimizerKind kind_;
    bool bf16_state_;
    std::vector<int64_t> steps_; // per parameter: the steps that updated it (bias correction)
    std::vector<at::Tensor> first_moment_;  // AdamW exp_avg, SGD momentum buffer
    std::vector<at::Tensor> second_moment_; // AdamW exp_avg_sq
    std::vector<uint8_t> seeded_;           // SGD: the momentum buffer holds a gradient
    std::atomic<int64_t> state_bytes_{0};
    size_t split_param_ = kNone; // split_next_update's parameter, until its update
    at::Tensor split_rows_;
    DeferredRows deferred_;

    // Updates, with a zero gradient, the rows of [row_begin, row_end) that `rows_done` marks 0.
    void update_deferred(const at::Tensor &rows_done, int64_t row_begin, int64_t row_end);

    void count_state(); // after allocating state
    // `update`: per parameter, whether this step updates it; `part`: the indices to visit.
    void step_adamw(const StepArrays &a, const OptimizerSettings &s,
                    const std::vector<bool> &update, const std::vector<size_t> &part,
                    const ParamDone &done);
    void step_sgd(const StepArrays &a, const OptimizerSettings &s, const std::vector<bool> &update,
                  const std::vector<size_t> &part, const ParamDone &done);
};

} // namespace rp
