// CPU time per thread name over a stretch of the run (Linux: /proc/self/task/<tid>/comm and
// stat). The engine names its threads (rp-optimizer, rp-gradients, rp-cuda<N>, rp-cuda<N>-up:
// src/base/thread_name.h) and their OpenMP teams inherit the names, so the figures say which part
// of the engine took the host's cores while the optimizer ran beside the pipeline.
#pragma once

#include <map>
#include <string>

#include "util.h"

namespace tb {

struct ThreadCpu {
    double ms = 0; // user + system time of the threads of this name
    int threads = 0;
};

// This process's threads now, by name; empty where /proc cannot be read (not Linux).
std::map<std::string, ThreadCpu> thread_cpu_by_name();

// What each name spent from `before` to `after` (threads that exited in between are not seen),
// as {"name": {"ms": ..., "threads": ..., "cores": ms / wall_ms}}, busiest first as a list.
json thread_cpu_between(const std::map<std::string, ThreadCpu> &before,
                        const std::map<std::string, ThreadCpu> &after, double wall_ms);

} // namespace tb
