// The device collectives of a data-parallel training call that have not been seen to complete,
// watched from the threads that wait for the GPUs (DataParallel::watch_device_collectives): a
// collective whose peer died never completes and its kernel spins, so the waits ask this list,
// and a failed or overdue collective fails the call.
//
// Those threads call in between 200 us sleeps, while a call has about two collectives per
// gradient group in flight (a hundred for Qwen3-1.7B). So a scan drops the collectives that have
// completed, and scans run at most every kScanInterval (far below any timeout): the event queries
// would otherwise compete with the threads that launch the kernels.
#pragma once
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace rp {

// The message for a gradient all-reduce on the GPUs that failed with `what`, wherever the failure
// is seen (launch, the watch, the call's end).
std::string all_reduce_failed(const std::string &what);

class CollectiveWatch {
  public:
    using Clock = std::chrono::steady_clock;
    static constexpr std::chrono::milliseconds kScanInterval{2};

    void add(c10::intrusive_ptr<c10d::Work> work, Clock::time_point started);
    // Why the first listed collective failed or is overdue (older than `timeout`), or "" when
    // none is, or when the last scan was less than kScanInterval before `now`. Collectives that
    // completed without an error leave the list.
    std::string scan(Clock::time_point now, std::chrono::milliseconds timeout);
    // The call has ended: every collective still listed, and the list emptied.
    std::vector<c10::intrusive_ptr<c10d::Work>> take_all();
    size_t size() const;

  private:
    struct Entry {
        c10::intrusive_ptr<c10d::Work> work;
        Clock::time_point started;
    };
    mutable std::mutex mutex_; // the device threads of one rank add concurrently
    std::vector<Entry> entries_;
    Clock::time_point last_scan_{};
};

} // namespace rp
