// CollectiveWatch (the data-parallel call's device collectives, watched for failures and
// timeouts) against fake c10d works whose state the test sets: the NCCL path it serves needs two
// GPUs, so its bookkeeping is checked here on its own, with the clock passed in.
//  - collectives that completed without an error leave the list; pending ones stay;
//  - an overdue collective, one that failed, and one that failed as it completed are reported
//    (the first listed wins) and stay listed for the call's end (take_all);
//  - scans closer together than kScanInterval report nothing, the next one does.
// Links src/engine/collective_watch.cpp directly (not exported by the library).
#include <chrono>
#include <stdexcept>
#include <string>

#include "engine/collective_watch.h"
#include "engine_check.h"

namespace {

using engine_test::check;

struct FakeWork : c10d::Work {
    bool completed = false;
    std::exception_ptr error;
    bool isCompleted() override { return completed; }
    std::exception_ptr exception() const override { return error; }
};

using Clock = rp::CollectiveWatch::Clock;
using std::chrono::milliseconds;
const milliseconds kTimeout{1000};

c10::intrusive_ptr<FakeWork> fake() { return c10::make_intrusive<FakeWork>(); }

bool contains(const std::string &text, const std::string &part) {
    return text.find(part) != std::string::npos;
}

void completed_ones_leave_pending_ones_stay() {
    rp::CollectiveWatch watch;
    const Clock::time_point t0 = Clock::now();
    auto done = fake(), pending = fake();
    done->completed = true;
    watch.add(done, t0);
    watch.add(pending, t0);
    check(watch.scan(t0 + milliseconds(10), kTimeout).empty(), "nothing failed or overdue");
    check(watch.size() == 1, "the completed collective left, the pending one stayed");
    auto rest = watch.take_all();
    check(rest.size() == 1 && rest[0].get() == pending.get(), "take_all: the pending one");
    check(watch.size() == 0, "take_all empties the list");
}

void overdue_and_failed_ones_are_reported_and_kept() {
    const Clock::time_point t0 = Clock::now();
    {
        rp::CollectiveWatch watch;
        watch.add(fake(), t0);
        check(watch.scan(t0 + milliseconds(999), kTimeout).empty(), "within the timeout");
        const std::string why = watch.scan(t0 + milliseconds(1001), kTimeout);
        check(contains(why, "did not complete within 1000 ms"), "overdue: '" + why + "'");
        check(watch.size() == 1, "an overdue collective stays listed");
    }
    {
        rp::CollectiveWatch watch;
        auto failed = fake();
        failed->error = std::make_exception_ptr(std::runtime_error("peer vanished"));
        watch.add(failed, t0);
        const std::string why = watch.scan(t0, kTimeout);
        check(contains(why, "failed: peer vanished"), "failed: '" + why + "'");
        check(watch.size() == 1, "a failed collective stays listed");
    }
    {
        rp::CollectiveWatch watch;
        auto failed_done = fake();
        failed_done->completed = true;
        failed_done->error = std::make_exception_ptr(std::runtime_error("NCCL error"));
        watch.add(failed_done, t0);
        const std::string why = watch.scan(t0, kTimeout);
        check(contains(why, "failed: NCCL error"), "completed with an error: '" + why + "'");
        check(watch.size() == 1, "a collective that completed with an error stays listed");
    }
    {
        rp::CollectiveWatch watch; // the first listed failure is the one reported
        auto done = fake(), first = fake(), second = fake();
        done->completed = true;
        first->error = std::make_exception_ptr(std::runtime_error("first"));
        second->error = std::make_exception_ptr(std::runtime_error("second"));
        watch.add(done, t0);
        watch.add(first, t0);
        watch.add(second, t0);
        const std::string why = watch.scan(t0, kTimeout);
        check(contains(why, "failed: first"), "the first failure: '" + why + "'");
        auto rest = watch.take_all();
        check(rest.size() == 2 && rest[0].get() == first.get() && rest[1].get() == second.get(),
              "the failed ones stay, in order; the completed one left");
    }
}

void scans_are_spaced() {
    rp::CollectiveWatch watch;
    const Clock::time_point t0 = Clock::now();
    auto failed = fake();
    check(watch.scan(t0, kTimeout).empty(), "an empty list");
    failed->error = std::make_exception_ptr(std::runtime_error("late"));
    watch.add(failed, t0);
    const auto interval = rp::CollectiveWatch::kScanInterval;
    check(watch.scan(t0 + interval / 2, kTimeout).empty(), "a scan too soon after the last");
    check(contains(watch.scan(t0 + interval, kTimeout), "failed: late"),
          "the next scan reports the failure");
}

} // namespace

int main() {
    completed_ones_leave_pending_ones_stay();
    overdue_and_failed_ones_are_reported_and_kept();
    scans_are_spaced();
    return engine_test::finish("collective watch");
}
