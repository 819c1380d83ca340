#include "memory.h"

#include <roundpipe.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include <sys/resource.h>

namespace tb {
namespace {

int64_t ru_maxrss_bytes() {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return static_cast<int64_t>(ru.ru_maxrss) * 1024; // KiB on Linux
}

// A field of /proc/self/status or /proc/meminfo in bytes ("VmHWM:", "MemAvailable:"); -1 if absent.
int64_t proc_kib_field(const char *file, const char *key) {
    std::ifstream f(file);
    std::string line;
    while (std::getline(f, line))
        if (line.rfind(key, 0) == 0)
            return std::stoll(line.substr(std::strlen(key))) * 1024;
    return -1;
}

} // namespace

int64_t mem_available_bytes() { return proc_kib_field("/proc/meminfo", "MemAvailable:"); }

bool reset_peak_rss() {
    FILE *f = std::fopen("/proc/self/clear_refs", "w");
    if (!f)
        return false;
    bool ok = std::fputs("5", f) >= 0;
    return std::fclose(f) == 0 && ok;
}

int64_t peak_rss_bytes() {
    int64_t hwm = proc_kib_field("/proc/self/status", "VmHWM:");
    return hwm > 0 ? hwm : ru_maxrss_bytes();
}

int64_t gpu_peak(int num_gpus) {
    int64_t peak = -1;
    for (int d = 0; d < num_gpus; ++d) {
        int64_t now = 0, p = 0;
        if (rp_cuda_memory_stats(&now, &p, d) == RP_OK)
            peak = std::max(peak, p);
    }
    return peak;
}

void gpu_reset_peak(int num_gpus) {
    for (int d = 0; d < num_gpus; ++d)
        rp_cuda_reset_peak_memory(d);
}

} // namespace tb
