#include "engine/grad_accumulator.h"

#include <algorithm>
#include <cmath>

#include <ATen/Parallel.h>

#include "base/error.h"
#include "base/host_threads.h"
#include "base/thread_name.h"
#include "engine/data_parallel.h"
#include "optim/bf16_convert.h"

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

void GradAccumulator::begin_call(bool buffers_zero, double factor,
                                 const std::vector<int> &jobs_per_param) {
    std::lock_guard<std::mutex> lock(mutex_);
    buffers_zero_ = buffers_zero;
    factor_ = factor;
    touched_.clear();
    held_.clear();
    error_ = nullptr;
    if (dp_) {
        dp_->check_usable();
        reducer_.begin_call(jobs_per_param);
    }
}

bool GradAccumulator::takes_row_gradients() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !dp_;
}

void GradAccumulator::report_final(const std::vector<int> &jobs_per_param, FinalFn fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    require(buffers_zero_, "in-call steps need zeroed gradients");
    auto t = std::make_unique<FinalTracking>();
    t->fn = std::move(fn);
    t->landed.resize(jobs_per_param.size());
    t->jobs = t->jobs_left = jobs_per_param;
    t->delivered.assign(jobs_per_param.size(), 0);
    t->received.assign(jobs_per_param.size(), 0);
    t->nonfinite.assign(jobs_per_param.size(), 0);
    t->handed.assign(jobs_per_param.size(), 0);
    final_ = std::move(t);
}

void GradAccumulator::hand_final(const Item &item, bool nonfinite) {
    FinalTracking &t = *final_;
    std::vector<FinalGradient> ready;
    auto check = [&](size_t p) {
        // Each job delivers a parameter at most once but for interim rows (FinalGradients sends
        // each leaf once; `delivered` leaves the interim ones out), so as many deliveries as jobs
        // means no job is left to add to it.
        if (!t.handed[p] && (t.jobs_left[p] == 0 || t.delivered[p] == t.jobs[p])) {
            t.handed[p] = 1;
            ready.push_back({p, t.received[p] != 0, t.nonfinite[p] != 0, std::move(t.landed[p])});
            t.landed[p] = at::Tensor();
        }
    };
    if (item.job_done) {
        for (size_t p : *item.job_done) {
            --t.jobs_left[p];
            check(p);
        }
    } else if (dp_) {
        // A reduced bucket: the reducer let it go once every job contributing to it had
        // finished, on every rank, so each of its gradients is final.
        for (const auto &g : item.grads) {
            ++t.delivered[g.first];
            t.received[g.first] = 1;
            t.nonfinite[g.first] |= nonfinite ? 1 : 0;
            t.jobs_left[g.first] = 0;
            check(g.first);
        }
    } else {
        for (const auto &g : item.grads) {
            // An earlier microbatch's rows: the job delivers this parameter again.
            if (!item.interim)
                ++t.delivered[g.first];
            t.received[g.first] = 1;
            t.nonfinite[g.first] |= nonfinite ? 1 : 0;
            check(g.first);
        }
    }
    if (ready.empty())
        return;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (const FinalGradient &f : ready)
            touched_.erase(f.param); // the listener's now: a failure must not zero it
    }
    t.fn(std::move(ready));
}

bool GradAccumulator::may_lend(size_t p, const at::Tensor &grad, const at::Tensor &dst,
                               double factor) const {
    if (!final_ || grad.is_sparse() || final_->jobs[p] != 1 || !buffers_zero_ || factor != 1.0 ||
        grad.scalar_type() != dst.scalar_type() || !grad.is_contiguous() ||
        grad.sizes() != dst.sizes())
        return false;
    const int64_t bytes = static_cast<int64_t>(grad.nbytes());
    return store_.lent_bytes() + bytes <= lend_limit_;
}

bool GradAccumulator::may_lend_standard(size_t p, const at::Tensor &grad, const at::Tensor &dst,
                                        double factor) {
    // The call's first contribution to a zero buffer. A later whole one is summed with it in
    // one pass (materialize_grad_adding: no more than widening the first as it landed and
    // adding the second would cost); rows (a tied embedding's, after its LM-head part) add into
    // the buffer beside it (mark_rows_added).
    if (final_ || dp_ || lend_limit_ <= 0 || !buffers_zero_ || factor != 1.0 ||
        grad.is_sparse() || grad.scalar_type() != at::kBFloat16 ||
        dst.scalar_type() != at::kFloat || !grad.is_contiguous() || grad.sizes() != dst.sizes() ||
        store_.grad_lent(p))
        return false;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (touched_.count(p))
            return false;
    }
    return store_.lent_bytes() + static_cast<int64_t>(grad.nbytes()) <= lend_limit_;
}

void GradAccumulator::enqueue(Item item) {
    if (!buffers_zero_) {
        held_.push_back(std::move(item));
        return;
    }
    queue_.push_back(std::move(item));
    ++in_flight_;
    changed_.notify_all();
}

void GradAccumulator::add(std::vector<std::pair<size_t, at::Tensor>> grads,
                          std::vector<at::Tensor> checks, Transfer ready, DeviceLane &lane,
                          bool interim) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (dp_) {
        require(!interim, "interim row gradients reached the data-parallel reduction");
        auto d = std::make_shared<GradientDownload>();
        *d = GradientDownload{std::move(grads), std::move(checks), std::move(ready), &lane};
        reducer_.receive(std::move(d));
        return;
    }
    Item item;
    item.grads = std::move(grads);
    item.checks = std::move(checks);
    item.ready = std::move(ready);
    item.lane = &lane;
    item.interim = interim;
    enqueue(std::move(item));
}

void GradAccumulator::job_done(const std::vector<size_t> &params) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (dp_) {
        reducer_.job_done(params);
    } else if (final_) { // behind the job's contributions in the queue
        Item item;
        item.job_done = params;
        queue_.push_back(std::move(item));
        ++in_flight_;
    } else {
        return;
    }
    changed_.notify_all();
}

void GradAccumulator::end_call(bool succeeded) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (dp_) {
        // A failed call stops reducing (the other ranks' collectives then time out); a
        // successful one has finished every job, so every bucket becomes ready.
        if (!succeeded || error_)
            reducer_.abort();
        changed_.notify_all();
        // Every job has finished: a bucket that is not ready now never will be.
        changed_.wait(lock, [&] {
            return !reducing_ && (reducer_.finished() || error_ || !reducer_.next_ready());
        });
        if (succeeded && !error_ && !reducer_.finished())
            error_ = std::make_exception_ptr(
                Error(ErrorKind::Internal, "data parallelism: a gradient bucket was never "
                                           "complete (jobs and parameters out of step)"));
        reducer_.abort();
    }
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
            store_.zero_grad(p);
    touched_.clear();
    final_.reset();
    if (error && succeeded)
        std::rethrow_exception(error);
}

namespace {

// dst += factor * src for a low-precision src: ATen's mixed-dtype add is a scalar loop (a tied
// embedding's 311M-element second contribution took 135 ms), so bf16 is widened in a vectorised
// loop and anything else a block at a time; both in parallel.
void add_widened(at::Tensor &dst, const at::Tensor &src, double factor) {
    constexpr int64_t kBlock = int64_t{1} << 16;
    at::Tensor d = dst.view(-1), s = src.reshape(-1);
    if (s.scalar_type() == at::kBFloat16 && d.scalar_type() == at::kFloat) {
        const auto *in = reinterpret_cast<const uint16_t *>(s.data_ptr());
        float *out = d.data_ptr<float>();
        const float f = static_cast<float>(factor);
        at::parallel_for(0, d.numel(), kBlock, [&](int64_t begin, int64_t end) {
            add_widened_bf16(in + begin, out + begin, end - begin, f);
        });
        return;
    }
    at::parallel_for(0, d.numel(), kBlock, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; b += kBlock) {
            const int64_t n = std::min(kBlock, end - b);
            d.narrow(0, b, n).add_(s.narrow(0, b, n).to(d.scalar_type()), factor);
        }
    });
}

// dst[row] += factor * values[i] for each (row, values[i]) of a row gradient: the rows an
// embedding's tokens used, a row once per use (the device did not merge repeats; here they add
// in fp32; into a bf16 gradient, a row's uses add to it in fp32 and it is rounded once).
void add_rows(at::Tensor &dst, const at::Tensor &sparse, double factor) {
    const at::Tensor rows = sparse._indices().reshape(-1).contiguous();
    const int64_t n = rows.numel(), width = dst.numel() / std::max<int64_t>(dst.size(0), 1);
    at::Tensor values = sparse._values().reshape({n, width});
    at::Tensor d = dst.view({dst.size(0), width});
    const bool bf16_values = values.scalar_type() == at::kBFloat16;
    if (bf16_values && d.scalar_type() == at::kFloat) {
        values = values.contiguous();
        add_rows_widened_bf16(reinterpret_cast<const uint16_t *>(values.data_ptr()),
                              rows.data_ptr<int64_t>(), n, width, d.data_ptr<float>(),
                              static_cast<float>(factor));
    } else if (bf16_values && d.scalar_type() == at::kBFloat16) {
        values = values.contiguous();
        add_rows_into_bf16(reinterpret_cast<const uint16_t *>(values.data_ptr()),
                           rows.data_ptr<int64_t>(), n, width,
                           reinterpret_cast<uint16_t *>(d.data_ptr()), static_cast<float>(factor));
    } else {
        d.index_add_(0, rows, values.to(d.scalar_type()), factor);
    }
}

} // namespace

void GradAccumulator::apply(const Item &item) {
    if (item.job_done) {
        hand_final(item, false);
        return;
    }
    if (item.lane)
        item.lane->wait(item.ready); // the download of these tensors has landed
    HostSpan span(timeline_, "gradients", "accumulate");
    double sum = 0.0;
    for (const at::Tensor &c : item.checks)
        sum += c.item<double>();
    const bool nonfinite = !std::isfinite(sum) || item.nonfinite;
    if (nonfinite)
        flags_.mark_nonfinite();
    const double factor = factor_ * item.scale;
    for (const auto &g : item.grads) {
        flags_.mark(g.first);
        at::Tensor &dst = store_.at(g.first).grad;
        if (may_lend(g.first, g.second, dst, factor)) { // handed below, the buffer untouched
            store_.count_lent(static_cast<int64_t>(g.second.nbytes()));
            final_->landed[g.first] = g.second;
            continue;
        }
        if (may_lend_standard(g.first, g.second, dst, factor)) {
            store_.lend_grad(g.first, g.second);
            std::lock_guard<std::mutex> lock(mutex_);
            touched_.insert(g.first); // a failing call gives it back
            continue;
        }
        bool first;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            first = buffers_zero_ && touched_.insert(g.first).second;
        }
        // Lent earlier: a bf16 whole contribution is summed with it in one pass, another one
        // adds after it is widened; rows add beside it.
        if (g.second.is_sparse())
            store_.mark_rows_added(g.first, g.second._indices());
        else if (factor == 1.0 && store_.materialize_grad_adding(g.first, g.second))
            continue;
        else
            store_.materialize_grad(g.first);
        if (g.second.is_sparse()) { // a zero buffer too: only the rows used change
            add_rows(dst, g.second, factor);
            continue;
        }
        const bool same_dtype = g.second.scalar_type() == dst.scalar_type();
        if (first) { // the buffer is zero: write instead of read-add-write
            if (same_dtype && factor != 1.0) {
                at::mul_out(dst, g.second, factor); // one pass
            } else {
                dst.copy_(g.second); // widened here: a low-precision product would round
                if (factor != 1.0)
                    dst.mul_(factor);
            }
        } else if (same_dtype) {
            dst.add_(g.second, factor);
        } else {
            add_widened(dst, g.second, factor);
        }
    }
    if (final_)
        hand_final(item, nonfinite);
}

void GradAccumulator::reduce_one(std::unique_lock<std::mutex> &lock) {
    GradientReducer::Bucket bucket = reducer_.take_next();
    reducing_ = true;
    lock.unlock();
    std::exception_ptr error;
    GradientReducer::Reduced reduced;
    try {
        HostSpan span(timeline_, "gradients", "all-reduce");
        reduced = reducer_.reduce(bucket, *dp_);
    } catch (...) {
        error = std::current_exception();
    }
    lock.lock();
    reducing_ = false;
    if (error) {
        if (!error_)
            error_ = error;
        reducer_.abort(); // the ranks are out of step: no further bucket
    } else {
        Item item;
        item.grads = std::move(reduced.grads);
        item.scale = reduced.scale;
        item.nonfinite = reduced.nonfinite;
        enqueue(std::move(item));
    }
    changed_.notify_all();
}

void GradAccumulator::loop() {
    name_this_thread("rp-gradients"); // before its OpenMP team exists: the team inherits it
    // The accumulation's parallel loops are OpenMP teams of this thread (host_threads.h).
    use_host_threads(nullptr);
    for (;;) {
        Item item;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            changed_.wait(lock, [&] {
                return stopping_ || !queue_.empty() || (dp_ && reducer_.next_ready());
            });
            if (queue_.empty() && dp_ && reducer_.next_ready() && !stopping_) {
                reduce_one(lock);
                continue;
            }
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
