// Names for the engine's own host threads, as `top -H`, `perf`, gdb and /proc/<pid>/task show
// them: rp-optimizer, rp-gradients, rp-cuda<N> and rp-cuda<N>-up (a device's worker and its
// uploader; rp-cpu / rp-cpu-up on a CPU device). A thread inherits its creator's name on Linux,
// so the OpenMP teams these threads start carry their names too: the host's cores can be
// accounted to the engine's parts (bench/train's per-thread CPU time does that).
#pragma once

#include <string>

namespace rp {

// Names the calling thread (at most 15 characters are kept: the kernel's limit). Best effort:
// a name that cannot be set changes nothing else.
void name_this_thread(const std::string &name);

} // namespace rp
