#include "base/host_memory.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace rp {
namespace {

void take_smaller(HostMemoryHeadroom &h, int64_t bytes, const char *source) {
    if (bytes < 0)
        return;
    if (h.bytes < 0 || bytes < h.bytes)
        h = {bytes, source};
}

int64_t mem_available() {
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

// A cgroup file holding one number; -1 when absent, unreadable or "max" (no limit).
int64_t read_number(const std::string &path) {
    std::ifstream in(path);
    std::string text;
    if (!(in >> text) || text == "max")
        return -1;
    errno = 0;
    char *end = nullptr;
    long long v = std::strtoll(text.c_str(), &end, 10);
    return errno != 0 || *end != '\0' || v < 0 ? -1 : static_cast<int64_t>(v);
}

// Limit minus usage of the memory cgroup in `dir`; -1 when it has no limit. cgroup v1 reports
// "no limit" as a huge page-rounded number, which is larger than any real headroom anyway.
int64_t cgroup_headroom(const std::string &dir, const char *limit_file, const char *usage_file) {
    const int64_t limit = read_number(dir + "/" + limit_file);
    const int64_t usage = read_number(dir + "/" + usage_file);
    if (limit < 0 || usage < 0 || limit >= (int64_t{1} << 60))
        return -1;
    return limit > usage ? limit - usage : 0;
}

// The process's memory cgroup from /proc/self/cgroup ("0::/path" for v2, "N:memory:/path" for
// v1). Inside a container its own cgroup is usually mounted at the root of /sys/fs/cgroup, so
// the root is tried when the named path does not exist there.
int64_t cgroup_memory_headroom() {
    std::ifstream in("/proc/self/cgroup");
    std::string line;
    int64_t best = -1;
    auto consider = [&best](int64_t h) {
        if (h >= 0 && (best < 0 || h < best))
            best = h;
    };
    while (std::getline(in, line)) {
        const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos)
            continue;
        const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
        if (controllers.empty()) { // v2
            int64_t h = cgroup_headroom("/sys/fs/cgroup" + path, "memory.max", "memory.current");
            consider(h >= 0 ? h
                            : cgroup_headroom("/sys/fs/cgroup", "memory.max", "memory.current"));
        } else if (controllers == "memory") { // v1
            const std::string root = "/sys/fs/cgroup/memory";
            int64_t h =
                cgroup_headroom(root + path, "memory.limit_in_bytes", "memory.usage_in_bytes");
            consider(h >= 0
                         ? h
                         : cgroup_headroom(root, "memory.limit_in_bytes", "memory.usage_in_bytes"));
        }
    }
    return best;
}

int64_t environment_limit() {
    const char *env = std::getenv("RP_HOST_MEMORY_LIMIT_MB");
    if (!env || !*env)
        return -1;
    errno = 0;
    char *end = nullptr;
    long long mb = std::strtoll(env, &end, 10);
    if (errno != 0 || *end != '\0' || mb < 0 || mb > (int64_t{1} << 40))
        return -1; // not a number of MiB: ignored, as other RP_ variables are
    return static_cast<int64_t>(mb) << 20;
}

} // namespace

HostMemoryHeadroom available_host_memory() {
    HostMemoryHeadroom h;
    take_smaller(h, mem_available(), "MemAvailable");
    take_smaller(h, cgroup_memory_headroom(), "the memory cgroup's limit minus its usage");
    take_smaller(h, environment_limit(), "RP_HOST_MEMORY_LIMIT_MB");
    return h;
}

} // namespace rp
