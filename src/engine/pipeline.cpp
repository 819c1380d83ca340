#include "engine/pipeline.h"

namespace rp {

Pipeline::Pipeline(const std::vector<at::Device> &devices) {
    for (const at::Device &d : devices)
        workers_.push_back(std::make_unique<DeviceWorker>(d));
}

void Pipeline::run(CallContext &ctx) {
    const size_t S = ctx.stages.size();
    const size_t M = ctx.num_microbatches();
    // Forward only: one job per stage. Fused: S - 1 forward jobs, the tail, S - 1 backward jobs.
    const size_t num_jobs = ctx.training ? 2 * S - 1 : S;
    CallState state(num_jobs, M);
    ctx.state = &state;
    ctx.stage_inputs.assign(S, std::vector<at::Tensor>(M));
    ctx.outputs.assign(M, at::Tensor());
    ctx.losses.assign(M, 0.0);
    ctx.job_grads.assign(num_jobs, {});

    const size_t G = workers_.size();
    for (size_t job = 0; job < num_jobs; ++job) {
        DeviceWorker &worker = *workers_[(cursor_ + job) % G];
        at::Device device = worker.device();
        worker.submit([&ctx, &state, job, S, device] {
            try {
                if (!ctx.training || job + 1 < S)
                    run_forward_job(ctx, job, job, device);
                else if (job + 1 == S)
                    run_tail_job(ctx, job, job, device);
                else
                    run_backward_job(ctx, job, 2 * S - 2 - job, device);
            } catch (const CallAborted &) {
                // Another job failed first; its error is the one reported.
            } catch (...) {
                state.fail(std::current_exception());
            }
            state.job_finished();
        });
    }
    std::exception_ptr error = state.wait_all();
    cursor_ = (cursor_ + num_jobs) % G;
    ctx.state = nullptr;
    if (error)
        std::rethrow_exception(error);
}

} // namespace rp
