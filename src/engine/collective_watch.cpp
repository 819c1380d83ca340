#include "engine/collective_watch.h"

namespace rp {

std::string all_reduce_failed(const std::string &what) {
    return "a gradient all-reduce on the GPUs failed: " + what;
}

void CollectiveWatch::add(c10::intrusive_ptr<c10d::Work> work, Clock::time_point started) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back({std::move(work), started});
}

std::string CollectiveWatch::scan(Clock::time_point now, std::chrono::milliseconds timeout) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (now - last_scan_ < kScanInterval)
        return "";
    last_scan_ = now;
    std::string failure;
    size_t kept = 0;
    for (Entry &entry : entries_) {
        std::string why;
        try {
            // Completion first: a collective that failed as it completed is reported, not dropped.
            const bool completed = entry.work->isCompleted();
            if (std::exception_ptr e = entry.work->exception())
                std::rethrow_exception(e);
            if (completed)
                continue; // done without an error: nothing left to watch
            if (now - entry.started > timeout)
                why = "a gradient all-reduce on the GPUs did not complete within " +
                      std::to_string(timeout.count()) + " ms";
        } catch (const std::exception &e) {
            why = all_reduce_failed(e.what());
        }
        if (failure.empty())
            failure = why;
        if (&entries_[kept] != &entry)
            entries_[kept] = std::move(entry);
        ++kept;
    }
    entries_.resize(kept);
    return failure;
}

std::vector<c10::intrusive_ptr<c10d::Work>> CollectiveWatch::take_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (Entry &entry : entries_)
        works.push_back(std::move(entry.work));
    entries_.clear();
    return works;
}

size_t CollectiveWatch::size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
}

} // namespace rp
