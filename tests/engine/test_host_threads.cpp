// The engine's host threads' count (src/base/host_threads.h), against hand-worked cases: an
// explicit count (RP_OPTIMIZER_THREADS) wins, ranks sharing a host split its cores (so torchrun's
// OMP_NUM_THREADS=1 for several local ranks does not starve them), one process keeps OpenMP's
// default; the optimizer in standard mode, half of that default.
#include <cstdio>
#include <cstdlib>

#include "base/host_threads.h"

static int failures = 0;

static void expect(int got, int want, const char *what) {
    if (got != want) {
        std::fprintf(stderr, "FAIL %s: got %d, want %d\n", what, got, want);
        ++failures;
    }
}

int main() {
    using rp::host_thread_count;
    // cores 32, OpenMP default 1 (torchrun's OMP_NUM_THREADS=1 for two local ranks)
    expect(host_thread_count(nullptr, "2", 32, 1), 16, "two local ranks share 32 cores");
    expect(host_thread_count(nullptr, "3", 32, 1), 10, "three local ranks: floor");
    expect(host_thread_count(nullptr, "64", 32, 1), 1, "more ranks than cores: one each");
    expect(host_thread_count("8", "2", 32, 1), 8, "RP_OPTIMIZER_THREADS wins");
    expect(host_thread_count("40", nullptr, 32, 32), 40, "explicit count above the cores");
    // one process: OpenMP's default
    expect(host_thread_count(nullptr, nullptr, 32, 32), 32, "one process, default");
    expect(host_thread_count(nullptr, "1", 32, 6), 6, "one local rank keeps OMP_NUM_THREADS");
    expect(host_thread_count("", "", 32, 12), 12, "empty text is unset");
    // text that is not a positive count is unset
    expect(host_thread_count("0", "2", 32, 1), 16, "zero threads is unset");
    expect(host_thread_count("-4", "2", 32, 1), 16, "negative is unset");
    expect(host_thread_count("8x", "2", 32, 1), 16, "trailing text is unset");
    expect(host_thread_count(nullptr, "two", 32, 7), 7, "local size not a count");
    expect(host_thread_count(nullptr, nullptr, 32, 0), 1, "at least one thread");
    // the optimizer: half of one process's default in standard mode, nothing else changes
    using rp::optimizer_thread_count;
    expect(optimizer_thread_count(nullptr, nullptr, 32, 32, true), 16, "standard mode: half");
    expect(optimizer_thread_count(nullptr, nullptr, 32, 32, false), 32, "memory-saving: all");
    expect(optimizer_thread_count(nullptr, nullptr, 32, 7, true), 3, "half of an odd default");
    expect(optimizer_thread_count(nullptr, nullptr, 32, 1, true), 1, "at least one thread");
    expect(optimizer_thread_count("24", nullptr, 32, 32, true), 24, "RP_OPTIMIZER_THREADS wins");
    expect(optimizer_thread_count(nullptr, "2", 32, 1, true), 16, "local ranks keep their share");
    expect(optimizer_thread_count("x", "1", 32, 12, true), 6, "invalid text, one rank: half");
    if (rp::available_cores() < 1) {
        std::fprintf(stderr, "FAIL available_cores below 1\n");
        ++failures;
    }
    if (failures == 0)
        std::printf("host_threads: all cases hold\n");
    return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
