// Small pieces every part of train_bench uses: the JSON type, the clock, progress lines on
// stderr, the error type and the check of rp_status results, and a few statistics.
#pragma once

#include <roundpipe.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tb {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0);

// One progress line on stderr ("[train_bench] ..."); stdout carries only the JSON line.
void progress(const std::string &msg);

struct BenchError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Throws BenchError naming the call, the status and the engine's message unless s is RP_OK.
void check(rp_status s, const char *what);
#define RP_CHECK(call) ::tb::check((call), #call)

// NaN for an empty vector.
double median(std::vector<double> v);
double mean(const std::vector<double> &v);

double round_to(double v, int digits);
json num_or_null(double v); // null for NaN and infinities

} // namespace tb
