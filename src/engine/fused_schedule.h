// A model of one fused training call's timeline on several devices, for the planner (issue 15:
// on two GPUs the device that runs one job more than the other paced the call).
//
// The jobs run in the pipeline's order: the forward stages, the tail (forward and backward of the
// last stage), the backward stages deepest first; job j on device j % devices (Pipeline's round
// robin). A job's microbatch m starts once its microbatch m - 1 is done, the job before it has
// handed over microbatch m, and its device has finished the job before it there. Transfers and
// weight uploads are left out: they overlap the compute, and the plans compared move the same
// bytes but for the hand-offs, which the tie-break towards fewer stages stands in for.
#pragma once
#include <cstddef>
#include <vector>

namespace rp {

// Milliseconds from the first job's start to the last job's end. `job_ms`: each job's compute
// time for all its microbatches, spread evenly over them.
double fused_call_ms(const std::vector<double> &job_ms, size_t devices, size_t microbatches);

// The fused call's jobs for stages whose layers have these compute times: per layer, a forward
// job's time and a backward job's (recompute and backward, the same work as the tail's forward
// and backward), summed over each stage [cuts[s], cuts[s + 1]).
std::vector<double> fused_job_ms(const std::vector<size_t> &cuts,
                                 const std::vector<double> &forward_ms,
                                 const std::vector<double> &backward_ms);

} // namespace rp
