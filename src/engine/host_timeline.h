// Host-side half of the timing record: what the caller thread, the optimizer thread and the
// gradient thread did, on the host clock, so a trace shows whether the GPUs wait for the host.
#pragma once
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace rp {

class HostTimeline {
  public:
    using Clock = std::chrono::steady_clock;

    struct Span {
        std::string thread; // "caller", "optimizer", "gradients"
        std::string what;
        Clock::time_point start, end;
    };

    // Starts a new call's record; spans that ended before it are dropped.
    void begin_call() {
        std::lock_guard<std::mutex> lock(mutex_);
        call_start_ = Clock::now();
        std::vector<Span> kept;
        for (Span &s : spans_)
            if (s.end >= call_start_)
                kept.push_back(std::move(s));
        spans_ = std::move(kept);
    }

    void add(std::string thread, std::string what, Clock::time_point start,
             Clock::time_point end) {
        std::lock_guard<std::mutex> lock(mutex_);
        spans_.push_back({std::move(thread), std::move(what), start, end});
    }

    Clock::time_point call_start() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return call_start_;
    }

    std::vector<Span> spans() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return spans_;
    }

  private:
    mutable std::mutex mutex_;
    Clock::time_point call_start_ = Clock::now();
    std::vector<Span> spans_;
};

// Records [construction, destruction) as one span.
class HostSpan {
  public:
    HostSpan(HostTimeline &timeline, std::string thread, std::string what)
        : timeline_(timeline), thread_(std::move(thread)), what_(std::move(what)),
          start_(HostTimeline::Clock::now()) {}
    ~HostSpan() { timeline_.add(thread_, what_, start_, HostTimeline::Clock::now()); }
    HostSpan(const HostSpan &) = delete;
    HostSpan &operator=(const HostSpan &) = delete;

  private:
    HostTimeline &timeline_;
    std::string thread_, what_;
    HostTimeline::Clock::time_point start_;
};

} // namespace rp
