#include "engine/grad_accumulator.h"

#include <algorithm>
#include <cmath>

#include <ATen/Parallel.h>

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

void GradAccumulator::add(std::vector<std::pair<size_t, at::Tensor>> grads,
                          std::vector<at::Tensor> checks, Transfer ready, DeviceLane &lane) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!buffers_zero_) {
        held_.push_back({std::move(grads), std::move(checks), std::move(ready), &lane});
        return;
    }
    queue_.push_back({std::move(grads), std::move(checks), std::move(ready), &lane});
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

namespace {

// dst += factor * src for a low-precision src: ATen's mixed-dtype add is a scalar loop (a tied
// embedding's 311M-element second contribution took 135 ms), so widen a block at a time, in
// parallel, and add in fp32.
void add_widened(at::Tensor &dst, const at::Tensor &src, double factor) {
    constexpr int64_t kBlock = int64_t{1} << 16;
    at::Tensor d = dst.view(-1), s = src.reshape(-1);
    at::parallel_for(0, d.numel(), kBlock, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; b += kBlock) {
            const int64_t n = std::min(kBlock, end - b);
            d.narrow(0, b, n).add_(s.narrow(0, b, n).to(d.scalar_type()), factor);
        }
    });
}

} // namespace

void GradAccumulator::apply(const Item &item) {
    item.lane->wait(item.ready); // the download of these tensors has landed
    HostSpan span(timeline_, "gradients", "accumulate");
    double sum = 0.0;
    for (const at::Tensor &c : item.checks)
        sum += c.item<double>();
    if (!std::isfinite(sum))
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
        } else if (g.second.scalar_type() == dst.scalar_type()) {
            dst.add_(g.second, factor_);
        } else {
            add_widened(dst, g.second, factor_);
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
