#include "engine/fused_schedule.h"

#include <algorithm>

namespace rp {

double fused_call_ms(const std::vector<double> &job_ms, size_t devices, size_t microbatches) {
    if (job_ms.empty() || devices == 0 || microbatches == 0)
        return 0.0;
    // done[m]: when the job before has finished microbatch m; device_free[d]: when device d's
    // last job finished its last microbatch (Pipeline's round robin: job j on device j % devices).
    std::vector<double> done(microbatches, 0.0), device_free(devices, 0.0);
    for (size_t j = 0; j < job_ms.size(); ++j) {
        const double each = job_ms[j] / static_cast<double>(microbatches);
        double previous = device_free[j % devices]; // this job's microbatch m - 1, or the device
        for (size_t m = 0; m < microbatches; ++m) {
            previous = std::max(previous, done[m]) + each;
            done[m] = previous;
        }
        device_free[j % devices] = previous;
    }
    return done[microbatches - 1];
}

std::vector<double> fused_job_ms(const std::vector<size_t> &cuts,
                                 const std::vector<double> &forward_ms,
                                 const std::vector<double> &backward_ms) {
    const size_t stages = cuts.size() - 1;
    auto sum = [&](const std::vector<double> &v, size_t s) {
        double total = 0;
        for (size_t l = cuts[s]; l < cuts[s + 1]; ++l)
            total += v[l];
        return total;
    };
    std::vector<double> jobs;
    for (size_t s = 0; s + 1 < stages; ++s)
        jobs.push_back(sum(forward_ms, s));
    jobs.push_back(sum(backward_ms, stages - 1)); // the tail
    for (size_t s = stages - 1; s-- > 0;)
        jobs.push_back(sum(backward_ms, s));
    return jobs;
}

} // namespace rp
