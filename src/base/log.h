// Library logging. The sink and progress.h's are the only global mutable state besides the
// thread-local error message: the API lets the user replace them.
#pragma once
#include <functional>
#include <string>

namespace rp {

enum class LogLevel { Debug = 0, Info = 1, Warn = 2, Error = 3 };

using LogSink = std::function<void(LogLevel, const std::string &)>;

// Installs `sink` for messages at or above `min_level`; an empty sink restores stderr output of
// warnings and errors. The environment variable RP_LOG_LEVEL (debug, info, warn, error), read at
// the first use of the log, overrides both thresholds.
void set_log_sink(LogSink sink, LogLevel min_level);
void log(LogLevel level, const std::string &message);

} // namespace rp
