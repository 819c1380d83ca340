// What the engine tests share: a check that prints and counts what failed, the report that ends
// a test program (its exit status), and the calling thread's name as the kernel holds it.
// Header-only: each test program includes it once.
#pragma once

#include <pthread.h>

#include <cstdio>
#include <string>

namespace engine_test {

inline int failures = 0;

inline void check(bool ok, const std::string &what) {
    if (ok)
        return;
    std::printf("FAILED: %s\n", what.c_str());
    ++failures;
}

// main's exit status: 1 when a check failed (with the count), 0 otherwise.
inline int finish(const char *what) {
    if (failures) {
        std::printf("%s: %d check(s) failed\n", what, failures);
        return 1;
    }
    std::printf("%s: all checks passed\n", what);
    return 0;
}

inline std::string this_thread_name() {
    char name[16] = {}; // the kernel keeps 15 characters and the terminating zero
    pthread_getname_np(pthread_self(), name, sizeof(name));
    return name;
}

} // namespace engine_test
