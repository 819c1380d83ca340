// The hand-over of an in-call step: the gradient thread pushes each batch of final gradients as
// the call produces them; the optimizer thread takes them and updates those parameters until the
// call closes the feed.
//
// Batches arrive deepest stage first (the backward's order), but the next call's forward needs
// the shallowest first: of the batches waiting, the optimizer takes the one of the lowest
// parameter index (parameters are numbered in layer order), so a backlog at the end of a call is
// worked off in the order the next call uploads the stages.
#pragma once
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/grad_accumulator.h"

namespace rp {

class FinalFeed {
  public:
    using Batch = std::vector<GradAccumulator::FinalGradient>;

    void push(Batch batch) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            batches_.push_back(std::move(batch));
        }
        changed_.notify_all();
    }
    // Caller thread, once no batch can follow. `failed`: the call failed.
    void close(bool failed) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            closed_ = true;
            failed_ = failed;
        }
        changed_.notify_all();
    }
    // Optimizer thread: the next batch; false once the feed is closed and empty.
    bool pop(Batch &out) {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return closed_ || !batches_.empty(); });
        if (batches_.empty())
            return false;
        auto first_param = [](const Batch &b) {
            size_t lowest = SIZE_MAX;
            for (const auto &f : b)
                lowest = std::min(lowest, f.param);
            return lowest;
        };
        auto next = std::min_element(batches_.begin(), batches_.end(),
                                     [&](const Batch &a, const Batch &b) {
                                         return first_param(a) < first_param(b);
                                     });
        out = std::move(*next);
        batches_.erase(next);
        return true;
    }
    bool failed() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return failed_;
    }

  private:
    mutable std::mutex mutex_;
    std::condition_variable changed_;
    std::deque<Batch> batches_;
    bool closed_ = false, failed_ = false;
};

} // namespace rp
