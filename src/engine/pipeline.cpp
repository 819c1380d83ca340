#include "engine/pipeline.h"

#include "engine/cuda_memory.h"
#include "base/error.h"

namespace rp {

Pipeline::Pipeline(const std::vector<at::Device> &devices) {
    for (const at::Device &d : devices)
        workers_.push_back(std::make_unique<DeviceWorker>(make_device_lane(d)));
}

namespace {

// What the user can change when a stage does not fit: the message names the stage and its layers.
Error stage_out_of_memory(const Stage &st, JobKind kind, size_t stage, const at::Device &device,
                          const c10::OutOfMemoryError &e) {
    return Error(ErrorKind::OutOfMemory,
                 std::string(kind == JobKind::Backward ? "backward stage " : "stage ") +
                     std::to_string(stage) + " (layers " + std::to_string(st.first_layer) +
                     " to " + std::to_string(st.end_layer - 1) + ") ran out of memory on " +
                     device.str() +
                     "; use more microbatches (smaller activations), recompute grain 'layer', "
                     "or a smaller GPU memory cap (smaller stages). " +
                     e.what_without_backtrace());
}

} // namespace

void Pipeline::run(CallContext &ctx) {
    const size_t M = ctx.num_microbatches();
    const std::vector<CallJob> jobs = call_jobs(ctx);
    const size_t num_jobs = jobs.size();
    CallState state(num_jobs, M);
    ctx.state = &state;
    if (ctx.kind != CallKind::BackwardOnly)
        ctx.stage_inputs.assign(ctx.backward_stages.size(), std::vector<Transfer>(M));
    ctx.outputs.assign(M, {});
    ctx.losses.assign(M, at::Tensor());

    const size_t G = workers_.size();
    for (auto &w : workers_)
        w->lane().begin_call();
    trace_.clear();
    ctx.job_device.resize(num_jobs);
    for (size_t job = 0; job < num_jobs; ++job)
        ctx.job_device[job] = (cursor_ + job) % G;
    std::vector<std::vector<StageJob>> per_worker(G);
    for (size_t job = 0; job < num_jobs; ++job) {
        const size_t device = ctx.job_device[job];
        const JobKind kind = jobs[job].kind;
        const size_t stage = jobs[job].stage;
        const Stage &layers = job_stage(ctx, kind, stage);
        trace_.push_back({job, stage, device, kind, {}});
        DeviceLane &lane = workers_[device]->lane();
        // The prefetch (weight upload) and the run share the uploaded weights and any failure.
        auto weights = std::make_shared<Transfer>();
        auto prefetch_error = std::make_shared<std::exception_ptr>();
        StageJob j;
        j.prefetch = [&ctx, &lane, weights, prefetch_error, &layers, job] {
            try {
                *weights = upload_stage_weights(ctx, layers, lane, job);
            } catch (...) {
                *prefetch_error = std::current_exception();
            }
        };
        j.ready = [&ctx, &layers] { return stage_weights_ready(ctx, layers); };
        j.run = [&ctx, &state, &lane, weights, prefetch_error, kind, stage, &layers, job] {
            try {
                if (*prefetch_error)
                    std::rethrow_exception(*prefetch_error);
                run_stage_job(ctx, kind, job, stage, lane, *weights);
            } catch (const CallAborted &) {
                // Another job failed first; its error is the one reported.
            } catch (const c10::OutOfMemoryError &e) {
                state.fail(std::make_exception_ptr(
                    stage_out_of_memory(layers, kind, stage, lane.device(), e)));
            } catch (...) {
                state.fail(std::current_exception());
            }
            *weights = Transfer(); // this stage's device weights may go now
            state.job_finished();
        };
        per_worker[device].push_back(std::move(j));
    }
    for (size_t d = 0; d < G; ++d)
        workers_[d]->submit(std::move(per_worker[d]));
    std::exception_ptr error = state.wait_all();
    // The host waits for the devices only here, where the call's results are handed back.
    // A lane's wait watch may give up on a device that will not finish (a dead rank's
    // collective): that fails the call like a job failure.
    bool devices_done = true;
    for (size_t d = 0; d < G; ++d) {
        try {
            std::vector<TraceSpan> spans = workers_[d]->lane().finish();
            for (TraceSpan &span : spans)
                trace_[span.job].spans.push_back(span);
        } catch (...) {
            devices_done = false;
            if (!error)
                error = std::current_exception();
        }
    }
    cursor_ = (cursor_ + num_jobs) % G;
    ctx.state = nullptr;
    if (error) {
        // Drop the failed call's tensors, then give their cached blocks back, so an
        // out-of-memory call leaves the devices as empty as they were.
        ctx.stage_inputs.clear();
        ctx.outputs.clear();
        if (!device(0).is_cpu() && devices_done) // freeing waits for the device
            release_cached_gpu_memory();
        std::rethrow_exception(error);
    }
}

} // namespace rp
