// The rows of a lookup table (an embedding first layer's weight) that a training call reads,
// posted by the call as its in-call step is queued and read by the step before it on the
// optimizer thread. With in-call steps that step updates the table in two parts (Model's
// deferred table rows, docs/semantics.md): the rows its own call used at once, the others once
// it has nothing else to do, except the ones the next call reads, which it updates as soon as
// that call posts them here, so that the next call's upload of the table need not wait for the
// rest.
#pragma once
#include <cstdint>
#include <mutex>

#include <ATen/ATen.h>

namespace rp {

class CallRows {
  public:
    // Caller thread: the call whose in-call step is `step` reads the rows `rows` marks (uint8
    // per row). Replaces what an earlier call posted.
    void post(int64_t step, at::Tensor rows) {
        std::lock_guard<std::mutex> lock(mutex_);
        step_ = step;
        rows_ = std::move(rows);
    }
    // Any thread: the rows the call of in-call step `step` posted; undefined if it has not.
    at::Tensor rows_of(int64_t step) const {
        std::lock_guard<std::mutex> lock(mutex_);
        return step_ == step ? rows_ : at::Tensor();
    }

  private:
    mutable std::mutex mutex_;
    int64_t step_ = 0;
    at::Tensor rows_;
};

} // namespace rp
