// The engine's one exception type. Everything the engine throws is an rp::Error (or a libtorch
// c10::Error, which the API boundary classifies); the API turns it into an rp_status.
#pragma once
#include <stdexcept>
#include <string>

namespace rp {

enum class ErrorKind { InvalidArgument, OutOfMemory, Io, Cuda, Callback, State, Internal };

class Error : public std::runtime_error {
  public:
    Error(ErrorKind kind, const std::string &message) : std::runtime_error(message), kind_(kind) {}
    ErrorKind kind() const { return kind_; }

  private:
    ErrorKind kind_;
};

[[noreturn]] inline void fail(ErrorKind kind, const std::string &message) {
    throw Error(kind, message);
}

inline void require(bool condition, const std::string &message) {
    if (!condition)
        fail(ErrorKind::InvalidArgument, message);
}

} // namespace rp
