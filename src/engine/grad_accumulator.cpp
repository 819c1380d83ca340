#include "engine/grad_accumulator.h"

#include <cmath>

namespace rp {

GradAccumulator::GradAccumulator(ParamStore &store, GradFlags &flags, HostTimeline &timeline)
    : store_(store), flags_(flags), timeline_(timeline), thread_([this] { loop(); }) {}

GradAccumulator::~GradAccumulator() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();
}

void GradAccumulator::begin_call(bool buffers_zero, double factor) {
    std::lock_guard<std::mutex> lock(mutex_);
    buffers_zero_ = buffers_zero;
    factor_ = factor;
    touched_.clear();
    held_.clear();
    error_ = nullptr;
}

void GradAccumulator::add(std::vector<std::pair<size_t, at::Tensor>> grads, at::Tensor check,
                          Transfer ready, DeviceLane &lane) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!buffers_zero_) {
        held_.push_back({std::move(grads), std::move(check), std::move(ready), &lane});
        return;
    }
    queue_.push_back({std::move(grads), std::move(check), std::move(ready), &lane});
    ++in_flight_;
    changed_.notify_all();
}

void GradAccumulator::end_call(bool succeeded) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (succeeded)
        for (Item &item : held_) {
            queue_.push_back(std::move(item));
            ++in_flight_;
        }
    held_.clear();
    changed_.notify_all();
    changed_.wait(lock, [&] { return in_flight_ == 0; });
    std::exception_ptr error = error_;
    error_ = nullptr;
    if ((!succeeded || error) && buffers_zero_)
        for (size_t p : touched_)
            store_.at(p).grad.zero_();
    touched_.clear();
    if (error && succeeded)
        std::rethrow_exception(error);
}

void GradAccumulator::apply(const Item &item) {
    item.lane->wait(item.ready); // the download of these tensors has landed
    HostSpan span(timeline_, "gradients", "accumulate");
    if (item.check.defined() && !std::isfinite(item.check.item<double>()))
        flags_.mark_nonfinite();
    for (const auto &g : item.grads) {
        flags_.mark(g.first);
        at::Tensor &dst = store_.at(g.first).grad;
        bool first;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            first = buffers_zero_ && touched_.insert(g.first).second;
        }
        if (first) { // the buffer is zero: write instead of read-add-write
            dst.copy_(g.second);
            if (factor_ != 1.0)
                dst.mul_(factor_);
        } else {
            dst.add_(g.second, factor_); // promotes into dst's dtype without a temporary
        }
    }
}

void GradAccumulator::loop() {
    for (;;) {
        Item item;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty())
                return;
            item = std::move(queue_.front());
            queue_.pop_front();
        }
        std::exception_ptr error;
        try {
            apply(item);
        } catch (...) {
            error = std::current_exception();
        }
        std::lock_guard<std::mutex> lock(mutex_);
        if (error && !error_)
            error_ = error;
        --in_flight_;
        changed_.notify_all();
    }
}

} // namespace rp
