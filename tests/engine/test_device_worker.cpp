// The device worker's order (src/engine/device_worker.h), with jobs that only record what ran on
// which thread: every job runs, in queue order, on the worker thread; each job after the first
// has its weight upload run before it, on the uploader thread, in job order; a job's upload runs
// while the job before it is still running (the worker no longer enqueues an upload before the
// compute of the job at hand); a job whose upload is not ready does its own, on the worker. The
// two threads carry the names thread_name.h gives them (rp-cpu, rp-cpu-up on a CPU device).
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/device_worker.h"
#include "engine_check.h"

namespace {

using engine_test::check;
using engine_test::this_thread_name;

class NoLane final : public rp::DeviceLane { // nothing is ever transferred here
  public:
    at::Device device() const override { return at::Device(at::kCPU); }
    void begin_call() override {}
    rp::Transfer upload_weights(const std::vector<at::Tensor> &, size_t) override {
        return rp::Transfer();
    }
    rp::Transfer upload(const rp::Transfer &from, size_t) override { return from; }
    void use(const rp::Transfer &) override {}
    rp::Transfer download(const std::vector<at::Tensor> &t, size_t, rp::Payload,
                          std::shared_ptr<void>) override {
        rp::Transfer out;
        out.tensors = t;
        return out;
    }
    void wait(const rp::Transfer &) override {}
    void compute_begin(size_t) override {}
    void compute_end(size_t) override {}
    void compute_end_ahead(size_t) override {}
    std::vector<rp::TraceSpan> finish() override { return {}; }
};

struct Event {
    std::string what; // "prefetch N" or "run N"
    std::thread::id thread;
    std::string thread_name;
};

struct Log {
    std::mutex mutex;
    std::condition_variable changed;
    std::vector<Event> events;
    size_t done = 0;

    void add(const std::string &what) {
        std::lock_guard<std::mutex> lock(mutex);
        events.push_back({what, std::this_thread::get_id(), this_thread_name()});
        changed.notify_all();
    }
    size_t index_of(const std::string &what) {
        std::lock_guard<std::mutex> lock(mutex);
        for (size_t i = 0; i < events.size(); ++i)
            if (events[i].what == what)
                return i;
        return SIZE_MAX;
    }
    // Waits (up to two seconds) for `what` to be logged; whether it was.
    bool wait_for(const std::string &what) {
        std::unique_lock<std::mutex> lock(mutex);
        return changed.wait_for(lock, std::chrono::seconds(2), [&] {
            for (const Event &e : events)
                if (e.what == what)
                    return true;
            return false;
        });
    }
    void finished() {
        std::lock_guard<std::mutex> lock(mutex);
        ++done;
        changed.notify_all();
    }
    void wait_done(size_t n) {
        std::unique_lock<std::mutex> lock(mutex);
        changed.wait_for(lock, std::chrono::seconds(10), [&] { return done == n; });
    }
};

// Jobs 0..n-1; job `ready_never` reports its upload as not ready. Job k's run waits until job
// k+1's upload has run, which only an upload running beside it can satisfy.
std::vector<rp::StageJob> jobs(Log &log, size_t n, size_t ready_never, bool wait_for_next) {
    std::vector<rp::StageJob> out;
    for (size_t k = 0; k < n; ++k) {
        rp::StageJob j;
        j.prefetch = [&log, k] { log.add("prefetch " + std::to_string(k)); };
        j.ready = [k, ready_never] { return k != ready_never; };
        j.run = [&log, k, n, ready_never, wait_for_next] {
            log.add("run " + std::to_string(k));
            if (wait_for_next && k + 1 < n && k + 1 != ready_never)
                log.wait_for("prefetch " + std::to_string(k + 1));
            log.finished();
        };
        out.push_back(std::move(j));
    }
    return out;
}

void uploads_run_beside_the_job_before_in_order() {
    Log log;
    const size_t n = 5;
    {
        rp::DeviceWorker worker(std::make_unique<NoLane>());
        worker.submit(jobs(log, n, SIZE_MAX, true));
        log.wait_done(n);
    }
    check(log.events.size() == 2 * n, "every job ran once with its upload");
    std::thread::id worker_thread = log.events[log.index_of("run 0")].thread;
    std::thread::id uploader_thread = log.events[log.index_of("prefetch 1")].thread;
    check(worker_thread != uploader_thread, "uploads after the first run on their own thread");
    check(log.events[log.index_of("prefetch 0")].thread == worker_thread,
          "the first job's upload runs on the worker");
    check(log.events[log.index_of("run 0")].thread_name == "rp-cpu", "the worker is rp-cpu");
    check(log.events[log.index_of("prefetch 1")].thread_name == "rp-cpu-up",
          "the uploader is rp-cpu-up");
    for (size_t k = 0; k < n; ++k) {
        const std::string run = "run " + std::to_string(k), pre = "prefetch " + std::to_string(k);
        check(log.index_of(pre) < log.index_of(run),
              "job " + std::to_string(k) + "'s upload first");
        check(log.events[log.index_of(run)].thread == worker_thread,
              "job " + std::to_string(k) + " runs on the worker");
        if (k > 0) {
            check(log.index_of("run " + std::to_string(k - 1)) < log.index_of(run),
                  "jobs in queue order");
            check(log.events[log.index_of(pre)].thread == uploader_thread,
                  "job " + std::to_string(k) + "'s upload on the uploader");
            check(log.index_of("prefetch " + std::to_string(k - 1)) < log.index_of(pre),
                  "uploads in job order");
        }
    }
}

void an_upload_not_ready_is_left_to_its_job() {
    Log log;
    const size_t n = 4;
    {
        rp::DeviceWorker worker(std::make_unique<NoLane>());
        worker.submit(jobs(log, n, 2, false));
        log.wait_done(n);
    }
    check(log.events.size() == 2 * n, "every job ran once with its upload (not ready)");
    check(log.index_of("run 1") < log.index_of("prefetch 2"),
          "a job whose upload is not ready uploads after the job before it");
    check(log.index_of("prefetch 2") < log.index_of("run 2"), "and before it runs");
    check(log.events[log.index_of("prefetch 2")].thread == log.events[log.index_of("run 2")].thread,
          "on the worker, as part of the job");
}

} // namespace

int main() {
    uploads_run_beside_the_job_before_in_order();
    an_upload_not_ready_is_left_to_its_job();
    return engine_test::finish("device worker");
}
