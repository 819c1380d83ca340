#include "base/log.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace rp {
namespace {

// RP_LOG_LEVEL, read once: -1 when unset or not a level name (then reported on stderr, since no
// sink can be trusted this early).
int level_from_environment() {
    const char *value = std::getenv("RP_LOG_LEVEL");
    if (!value || !*value)
        return -1;
    std::string name;
    for (const char *c = value; *c; ++c)
        name += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    if (name == "debug")
        return static_cast<int>(LogLevel::Debug);
    if (name == "info")
        return static_cast<int>(LogLevel::Info);
    if (name == "warn" || name == "warning")
        return static_cast<int>(LogLevel::Warn);
    if (name == "error")
        return static_cast<int>(LogLevel::Error);
    std::fprintf(stderr,
                 "roundpipe warning: RP_LOG_LEVEL=%s is not one of debug, info, warn, error; "
                 "ignored\n",
                 value);
    return -1;
}

struct LogState {
    std::mutex mutex;
    LogSink sink;
    // RP_LOG_LEVEL overrides every sink's threshold, the caller's min_level included.
    const int env_level = level_from_environment();
    LogLevel min_level = env_level >= 0 ? static_cast<LogLevel>(env_level) : LogLevel::Warn;
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
    LogState &s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.sink = std::move(sink);
    if (s.env_level >= 0)
        s.min_level = static_cast<LogLevel>(s.env_level);
    else
        s.min_level = s.sink ? min_level : LogLevel::Warn;
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
