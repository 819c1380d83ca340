// Versions, status strings, errors, logging, progress, device discovery.
#include <cstring>

#include "api/api_guard.h"
#include "base/log.h"
#include "base/progress.h"
#include "engine/model.h"

#include <torch/version.h> // TORCH_VERSION: the libtorch this file is compiled against

using namespace rp;

extern "C" {

const char *rp_version(void) { return RP_VERSION_STRING; }

int32_t rp_abi_version(void) { return RP_ABI_VERSION; }

const char *rp_torch_version(void) { return TORCH_VERSION; }

const char *rp_status_string(rp_status status) {
    // A C caller may pass any int: read the bits, since loading an out-of-range value as the C++
    // enum is undefined behaviour.
    int32_t code;
    static_assert(sizeof code == sizeof status, "rp_status is an int");
    std::memcpy(&code, &status, sizeof code);
    switch (code) {
    case RP_OK:
        return "ok";
    case RP_ERR_INVALID_ARGUMENT:
        return "invalid argument";
    case RP_ERR_OUT_OF_MEMORY:
        return "out of memory";
    case RP_ERR_IO:
        return "i/o error";
    case RP_ERR_CUDA:
        return "CUDA error";
    case RP_ERR_CALLBACK:
        return "callback failed";
    case RP_ERR_STATE:
        return "invalid state";
    case RP_ERR_INTERNAL:
        return "internal error";
    }
    return "unknown status";
}

const char *rp_last_error_message(void) { return last_error_message(); }

rp_status rp_set_log_callback(rp_log_fn fn, int32_t min_level, void *user_data) {
    return guard([&] {
        require_arg(min_level >= RP_LOG_DEBUG && min_level <= RP_LOG_ERROR,
                    "min_level must be one of RP_LOG_DEBUG..RP_LOG_ERROR");
        LogSink sink;
        if (fn)
            sink = [fn, user_data](LogLevel level, const std::string &message) {
                fn(static_cast<int32_t>(level), message.c_str(), user_data);
            };
        set_log_sink(std::move(sink), static_cast<LogLevel>(min_level));
    });
}

rp_status rp_set_progress_callback(rp_progress_fn fn, void *user_data) {
    return guard([&] {
        ProgressSink sink;
        if (fn)
            sink = [fn, user_data](const std::string &what, int64_t done, int64_t total) {
                fn(what.c_str(), done, total, user_data);
            };
        set_progress_sink(std::move(sink));
    });
}

rp_status rp_cuda_device_count(int32_t *out_count) {
    return guard([&] {
        require_arg(out_count, "out_count is NULL");
        *out_count = visible_cuda_devices();
    });
}

} // extern "C"
