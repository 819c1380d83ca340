#include "base/host_threads.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace rp {
namespace {

// A positive count, or 0 for unset or anything else.
int positive_count(const char *text) {
    if (!text || !*text)
        return 0;
    char *end = nullptr;
    const long n = std::strtol(text, &end, 10);
    return (*end == '\0' && n > 0 && n <= (1 << 16)) ? static_cast<int>(n) : 0;
}

} // namespace

int host_thread_count(const char *requested, const char *local_world_size, int cores,
                      int openmp_default) {
    if (const int n = positive_count(requested))
        return n;
    const int local = positive_count(local_world_size);
    if (local > 1)
        return std::max(1, cores / local);
    return std::max(1, openmp_default);
}

int optimizer_thread_count(const char *requested, const char *local_world_size, int cores,
                           int openmp_default, bool beside_whole_calls) {
    // Only the last of host_thread_count's three sources changes: an explicit count and the
    // ranks' share stay as they are.
    return host_thread_count(requested, local_world_size, cores,
                             beside_whole_calls ? openmp_default / 2 : openmp_default);
}

int available_cores() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        return std::max(1, CPU_COUNT(&set));
    return std::max(1u, std::thread::hardware_concurrency());
}

int use_host_threads(const char *requested) {
    const int n = host_thread_count(requested, std::getenv("LOCAL_WORLD_SIZE"), available_cores(),
                                    omp_get_max_threads());
    omp_set_num_threads(n);
    return n;
}

int use_optimizer_threads(bool beside_whole_calls) {
    const int n =
        optimizer_thread_count(std::getenv("RP_OPTIMIZER_THREADS"), std::getenv("LOCAL_WORLD_SIZE"),
                               available_cores(), omp_get_max_threads(), beside_whole_calls);
    omp_set_num_threads(n);
    return n;
}

} // namespace rp
