// The engine's thread names (src/base/thread_name.h), read back from the kernel: a name is set on
// the calling thread only, a long one keeps its first 15 characters (the kernel's limit), and an
// OpenMP team started by a named thread carries the name, which is what lets the benchmark's
// per-thread CPU time account the optimizer's team to rp-optimizer.
#include <omp.h>

#include <string>
#include <thread>
#include <vector>

#include "base/thread_name.h"
#include "engine_check.h"

using engine_test::check;
using engine_test::this_thread_name;

int main() {
    const std::string main_name = this_thread_name();
    std::string named, truncated;
    std::vector<std::string> team(4);
    int team_size = 0;
    std::thread([&] {
        rp::name_this_thread("rp-optimizer");
        named = this_thread_name();
        // A team made after the name: the first parallel region of this thread creates it.
#pragma omp parallel num_threads(4)
        {
#pragma omp single
            team_size = omp_get_num_threads();
            team[static_cast<size_t>(omp_get_thread_num())] = this_thread_name();
        }
        rp::name_this_thread("abcdefghijklmnopqrstuvwxyz");
        truncated = this_thread_name();
    }).join();
    check(named == "rp-optimizer", "the thread is named (got " + named + ")");
    check(truncated == "abcdefghijklmno",
          "a long name keeps 15 characters (got " + truncated + ")");
    check(this_thread_name() == main_name, "the calling thread only");
    check(team_size == 4, "a team of four");
    for (int i = 0; i < team_size; ++i)
        check(team[static_cast<size_t>(i)] == "rp-optimizer",
              "team member " + std::to_string(i) + " carries the name (got " +
                  team[static_cast<size_t>(i)] + ")");
    return engine_test::finish("thread names");
}
