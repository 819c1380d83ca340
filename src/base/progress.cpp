#include "base/progress.h"

#include <algorithm>
#include <mutex>

namespace rp {
namespace {

struct ProgressState {
    std::mutex mutex;
    ProgressSink sink;
};

ProgressState &state() {
    static ProgressState s;
    return s;
}

void report(const std::string &what, int64_t done, int64_t total) {
    ProgressState &s = state();
    // Held during the call, so that set_progress_sink can promise that the old sink is idle.
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.sink)
        return;
    try {
        s.sink(what, done, total);
    } catch (...) {
        // A progress display must not fail the load or save it watches.
    }
}

} // namespace

void set_progress_sink(ProgressSink sink) {
    std::lock_guard<std::mutex> lock(state().mutex);
    state().sink = std::move(sink);
}

ProgressReport::ProgressReport(std::string what, int64_t total)
    : what_(std::move(what)), total_(std::max<int64_t>(total, 0)) {
    report(what_, 0, total_);
}

void ProgressReport::advance(int64_t amount) {
    done_ = std::min(done_ + std::max<int64_t>(amount, 0), total_);
    // The final report belongs to finish(), which comes only when all the work is done.
    if (done_ < total_)
        report(what_, done_, total_);
}

void ProgressReport::finish() {
    if (finished_)
        return;
    finished_ = true;
    done_ = total_;
    report(what_, total_, total_);
}

} // namespace rp
