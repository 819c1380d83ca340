#include "base/log.h"

#include <cstdio>
#include <mutex>

namespace rp {
namespace {

struct LogState {
    std::mutex mutex;
    LogSink sink;
    LogLevel min_level = LogLevel::Warn;
};

LogState &state() {
    static LogState s;
    return s;
}

const char *level_name(LogLevel level) {
    switch (level) {
    case LogLevel::Debug:
        return "debug";
    case LogLevel::Info:
        return "info";
    case LogLevel::Warn:
        return "warning";
    case LogLevel::Error:
        return "error";
    }
    return "?";
}

} // namespace

void set_log_sink(LogSink sink, LogLevel min_level) {
    std::lock_guard<std::mutex> lock(state().mutex);
    state().sink = std::move(sink);
    state().min_level = state().sink ? min_level : LogLevel::Warn;
}

void log(LogLevel level, const std::string &message) {
    LogState &s = state();
    // The lock also serialises sink calls, which the header promises.
    std::lock_guard<std::mutex> lock(s.mutex);
    if (level < s.min_level)
        return;
    if (s.sink) {
        try {
            s.sink(level, message);
        } catch (...) {
            // A throwing sink must not take the engine down with it.
        }
        return;
    }
    std::fprintf(stderr, "roundpipe %s: %s\n", level_name(level), message.c_str());
}

} // namespace rp
