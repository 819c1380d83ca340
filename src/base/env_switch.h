// The engine's measurement switches: features that stay on unless an environment variable says
// "0", so that one build can measure what each gives (bench/run_env_ab.sh alternates them).
// include/roundpipe.h lists every variable the library reads.
#pragma once
#include <cstdlib>
#include <cstring>

namespace rp {

// False when the variable `name` is exactly "0"; true when it is unset, empty or anything else.
// Callers that read a switch once keep its value in a static of their own.
inline bool env_switch_on(const char *name) {
    const char *value = std::getenv(name);
    return !(value && std::strcmp(value, "0") == 0);
}

} // namespace rp
