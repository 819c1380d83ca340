#include "util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace tb {

double ms_since(Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void progress(const std::string &msg) {
    std::fprintf(stderr, "[train_bench] %s\n", msg.c_str());
    std::fflush(stderr);
}

void check(rp_status s, const char *what) {
    if (s != RP_OK)
        throw BenchError(std::string(what) + " failed: " + rp_status_string(s) + ": " +
                         rp_last_error_message());
}

double median(std::vector<double> v) {
    if (v.empty())
        return std::numeric_limits<double>::quiet_NaN();
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double> &v) {
    double s = 0;
    for (double x : v)
        s += x;
    return v.empty() ? std::numeric_limits<double>::quiet_NaN() : s / v.size();
}

double round_to(double v, int digits) {
    double f = std::pow(10.0, digits);
    return std::round(v * f) / f;
}

json num_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

} // namespace tb
