#include "api/api_guard.h"

#include <new>

#include <c10/util/Exception.h>

namespace rp {
namespace {

thread_local std::string last_error;

rp_status status_of(ErrorKind kind) {
    switch (kind) {
    case ErrorKind::InvalidArgument:
        return RP_ERR_INVALID_ARGUMENT;
    case ErrorKind::OutOfMemory:
        return RP_ERR_OUT_OF_MEMORY;
    case ErrorKind::Io:
        return RP_ERR_IO;
    case ErrorKind::Cuda:
        return RP_ERR_CUDA;
    case ErrorKind::Callback:
        return RP_ERR_CALLBACK;
    case ErrorKind::State:
        return RP_ERR_STATE;
    case ErrorKind::Internal:
        return RP_ERR_INTERNAL;
    }
    return RP_ERR_INTERNAL;
}

} // namespace

void set_last_error(const std::string &message) { last_error = message; }

const char *last_error_message() { return last_error.c_str(); }

rp_status status_from_current_exception() {
    try {
        throw;
    } catch (const Error &e) {
        set_last_error(e.what());
        return status_of(e.kind());
    } catch (const c10::OutOfMemoryError &e) {
        set_last_error(std::string("out of memory: ") + e.what_without_backtrace());
        return RP_ERR_OUT_OF_MEMORY;
    } catch (const c10::IndexError &e) {
        set_last_error(e.what_without_backtrace());
        return RP_ERR_INVALID_ARGUMENT;
    } catch (const c10::ValueError &e) {
        set_last_error(e.what_without_backtrace());
        return RP_ERR_INVALID_ARGUMENT;
    } catch (const c10::TypeError &e) {
        set_last_error(e.what_without_backtrace());
        return RP_ERR_INVALID_ARGUMENT;
    } catch (const c10::Error &e) {
        std::string msg = e.what_without_backtrace();
        set_last_error(msg);
        // libtorch's CPU allocator reports a failed allocation as a plain c10::Error.
        if (msg.find("can't allocate memory") != std::string::npos ||
            msg.find("out of memory") != std::string::npos)
            return RP_ERR_OUT_OF_MEMORY;
        return msg.find("CUDA") != std::string::npos ? RP_ERR_CUDA : RP_ERR_INTERNAL;
    } catch (const std::bad_alloc &) {
        set_last_error("out of host memory");
        return RP_ERR_OUT_OF_MEMORY;
    } catch (const std::exception &e) {
        set_last_error(std::string("internal error: ") + e.what());
        return RP_ERR_INTERNAL;
    } catch (...) {
        set_last_error("internal error: unknown exception");
        return RP_ERR_INTERNAL;
    }
}

} // namespace rp
