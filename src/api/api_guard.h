// The ABI boundary's error handling: every exported function runs its body through guard(),
// which turns any exception into an rp_status plus a thread-local message.
#pragma once
#include <string>

#include "roundpipe_internal.h"

namespace rp {

void set_last_error(const std::string &message);
const char *last_error_message();
rp_status status_from_current_exception();

template <typename Body> rp_status guard(Body &&body) noexcept {
    try {
        set_last_error("");
        body();
        return RP_OK;
    } catch (...) {
        return status_from_current_exception();
    }
}

// Validation helpers for exported functions.
inline void require_arg(bool ok, const char *what) {
    if (!ok)
        fail(ErrorKind::InvalidArgument, what);
}

} // namespace rp
