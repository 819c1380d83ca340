#include "engine/collective_watch.h"

namespace rp {

void CollectiveWatch::add(c10::intrusive_ptr<c10d::Work> work, Clock::time_point started) {
    std::lock_guard<std::mutex> lock(mutex_);
    works_.push_back(std::move(work));
    started_.push_back(started);
}

std::string CollectiveWatch::scan(Clock::time_point now, std::chrono::milliseconds timeout) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (now - last_scan_ < kScanInterval)
        return "";
    last_scan_ = now;
    std::string failure;
    size_t kept = 0;
    for (size_t i = 0; i < works_.size(); ++i) {
        c10d::Work &w = *works_[i];
        std::string why;
        try {
            if (std::exception_ptr e = w.exception())
                std::rethrow_exception(e);
            if (w.isCompleted()) {
                if (std::exception_ptr e = w.exception()) // failed as it completed
                    std::rethrow_exception(e);
                continue; // done without an error: nothing left to watch
            }
            if (now - started_[i] > timeout)
                why = "a gradient all-reduce on the GPUs did not complete within " +
                      std::to_string(timeout.count()) + " ms";
        } catch (const std::exception &e) {
            why = std::string("a gradient all-reduce on the GPUs failed: ") + e.what();
        }
        if (failure.empty())
            failure = why;
        if (kept != i) {
            works_[kept] = std::move(works_[i]);
            started_[kept] = started_[i];
        }
        ++kept;
    }
    works_.resize(kept);
    started_.resize(kept);
    return failure;
}

std::vector<c10::intrusive_ptr<c10d::Work>> CollectiveWatch::take_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    works.swap(works_);
    started_.clear();
    return works;
}

size_t CollectiveWatch::size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return works_.size();
}

} // namespace rp
