#include "base/host_memory.h"

#include <cstdio>
#include <cstring>

namespace rp {

int64_t available_host_memory_bytes() {
    std::FILE *f = std::fopen("/proc/meminfo", "r");
    if (!f)
        return -1;
    char line[256];
    long long kib = -1;
    while (std::fgets(line, sizeof line, f))
        if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1)
            break;
    std::fclose(f);
    return kib < 0 ? -1 : static_cast<int64_t>(kib) * 1024;
}

} // namespace rp
