#include "engine/pipeline.h"

#include <string>

#include "base/env_switch.h"
#include "base/error.h"
#include "engine/cuda_memory.h"

namespace rp {

Pipeline::Pipeline(const std::vector<at::Device> &devices) {
    std::vector<int> gpus;
    for (const at::Device &d : devices) {
        workers_.push_back(std::make_unique<DeviceWorker>(make_device_lane(d)));
        if (d.is_cuda())
            gpus.push_back(d.index());
    }
    // RP_PEER_HAND_OFFS=0 sends hand-offs through host memory, to measure what the direct
    // copies give.
    peer_hand_offs_ = gpus.size() == devices.size() && env_switch_on("RP_PEER_HAND_OFFS") &&
                      gpus_copy_peer_to_peer(gpus);
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

// `carried` into `weights` when it holds what `stage` reads now (carried_weights_match); else
// false, and `carried`, given up, frees its device memory.
bool take_carried(const CallContext &ctx, const Stage &stage, CarriedWeights carried,
                  Transfer &weights) {
    const std::vector<size_t> params = stage_params(ctx, stage);
    std::vector<at::Tensor> live;
    for (size_t pi : params)
        live.push_back(ctx.store.at(pi).live);
    if (!carried_weights_match(carried, params, live, ctx.store.weights_version()))
        return false;
    weights = std::move(carried.transfer);
    return true;
}

// Whether `bytes` more fit on the GPU of `lane` under `cap` (0: unknown, so no), with a tenth
// of the cap kept for the allocator's rounding and the last job's late allocations.
bool room_on_gpu(DeviceLane &lane, int64_t bytes, int64_t cap) {
    if (cap <= 0)
        return false;
    const int64_t held = gpu_memory_stats(lane.device().index()).allocated_bytes;
    return held + bytes <= cap / 10 * 9;
}

} // namespace

std::function<void()> Pipeline::next_call_upload(CallContext &ctx,
                                                 const std::vector<CallJob> &jobs, size_t d) {
    const size_t G = workers_.size(), num_jobs = jobs.size();
    // The next call starts at the device after the one this call's cursor ends on; expect it to
    // run the same jobs (its first jobs on d check, and drop an upload that does not match).
    const size_t next_cursor = (cursor_ + num_jobs) % G;
    std::vector<const Stage *> stages;
    std::vector<size_t> tags;
    for (size_t k = 0, job = (d + G - next_cursor) % G; k < kCarriedJobs && job < num_jobs;
         ++k, job += G) {
        stages.push_back(&job_stage(ctx, jobs[job].kind, jobs[job].stage));
        JobTrace &trace = trace_[num_jobs + kCarriedJobs * d + k];
        trace.stage = jobs[job].stage;
        trace.kind = jobs[job].kind;
        tags.push_back(trace.job);
    }
    if (stages.empty())
        return {};
    DeviceLane &lane = workers_[d]->lane();
    std::vector<CarriedWeights> *out = &carried_[d];
    const int64_t cap = ctx.gpu_memory_cap;
    return [&ctx, &lane, stages, tags, out, cap] {
        lane.begin_next_call_uploads();
        for (size_t k = 0; k < stages.size(); ++k) {
            try {
                CarriedWeights c;
                c.params = stage_params(ctx, *stages[k]);
                c.sources = ctx.next_call_weights(c.params, &c.version);
                if (c.sources.empty())
                    return; // not final yet: the next call uploads them itself
                // The second job's weights join this job's and the first's on the GPU: only
                // where the memory cap leaves room for a third stage.
                if (k > 0 && !room_on_gpu(lane, bytes_of(c.sources), cap))
                    return;
                c.transfer = lane.upload_weights(c.sources, tags[k]);
                (*out)[k] = std::move(c);
            } catch (...) {
                return; // only a head start: whatever went wrong, the next call uploads
            }
        }
    };
}

void Pipeline::wait_for_next_call_uploads() {
    for (size_t d = 0; d < carried_.size() && d < workers_.size(); ++d)
        for (const CarriedWeights &c : carried_[d])
            workers_[d]->lane().wait(c.transfer);
}

void Pipeline::run(CallContext &ctx) {
    const size_t M = ctx.num_microbatches();
    const std::vector<CallJob> jobs = call_jobs(ctx);
    const size_t num_jobs = jobs.size();
    CallState state(num_jobs, M, ctx.backward_stages.size(),
                    ctx.kind == CallKind::BackwardOnly);
    ctx.state = &state;
    if (ctx.kind != CallKind::BackwardOnly)
        ctx.stage_inputs.assign(ctx.backward_stages.size(), std::vector<Transfer>(M));
    ctx.outputs.assign(M, {});
    ctx.losses.assign(M, at::Tensor());

    const size_t G = workers_.size();
    for (auto &w : workers_)
        w->lane().begin_call();
    // The last call's trace names its uploads for this call that were still in flight as it
    // ended (their spans come with this call's, under the job index they had there).
    const std::vector<JobTrace> previous_trace = std::move(trace_);
    trace_.clear();
    // What the last call uploaded for this one: each device's first jobs take their own, or drop
    // it (and its device memory) before uploading anything else.
    std::vector<std::vector<CarriedWeights>> carried_in = std::move(carried_);
    carried_in.resize(G);
    for (auto &c : carried_in)
        c.resize(kCarriedJobs);
    carried_.assign(G, std::vector<CarriedWeights>(kCarriedJobs));
    ctx.peer_hand_offs = peer_hand_offs_;
    ctx.job_device.resize(num_jobs);
    for (size_t job = 0; job < num_jobs; ++job) {
        ctx.job_device[job] = (cursor_ + job) % G;
        trace_.push_back({job, jobs[job].stage, ctx.job_device[job], jobs[job].kind, {}});
    }
    // The uploads for the next call, should there be any: job num_jobs + kCarriedJobs * d + k
    // for the next call's k-th job on device d.
    for (size_t d = 0; d < G; ++d)
        for (size_t k = 0; k < kCarriedJobs; ++k)
            trace_.push_back({trace_.size(), 0, d, JobKind::Forward, {}, true});
    std::vector<std::vector<StageJob>> per_worker(G);
    for (size_t job = 0; job < num_jobs; ++job) {
        const size_t device = ctx.job_device[job];
        const JobKind kind = jobs[job].kind;
        const size_t stage = jobs[job].stage;
        const Stage &layers = job_stage(ctx, kind, stage);
        DeviceLane &lane = workers_[device]->lane();
        // The prefetch (weight upload) and the run share the uploaded weights and any failure.
        auto weights = std::make_shared<Transfer>();
        auto prefetch_error = std::make_shared<std::exception_ptr>();
        StageJob j;
        // Jobs kG to kG + G - 1 are the k-th on their devices.
        CarriedWeights *carried = job / G < kCarriedJobs ? &carried_in[device][job / G] : nullptr;
        j.prefetch = [&ctx, &lane, weights, prefetch_error, &layers, job, carried] {
            try {
                if (!(carried && take_carried(ctx, layers, std::move(*carried), *weights)))
                    *weights = upload_stage_weights(ctx, layers, lane, job);
            } catch (...) {
                *prefetch_error = std::current_exception();
            }
        };
        j.ready = [&ctx, &layers] { return stage_weights_ready(ctx, layers); };
        // The device's last job: once its own work is enqueued (so that its activation uploads
        // are not queued behind these weights), the uploads for the next call.
        std::function<void()> carry;
        if (ctx.next_call_weights && job + G >= num_jobs && lane.device().is_cuda())
            carry = next_call_upload(ctx, jobs, device);
        j.run = [&ctx, &state, &lane, weights, prefetch_error, kind, stage, &layers, job, carry] {
            try {
                if (*prefetch_error)
                    std::rethrow_exception(*prefetch_error);
                run_stage_job(ctx, kind, job, stage, lane, *weights);
                if (carry)
                    carry();
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
            for (TraceSpan &span : spans) {
                if (!span.from_last_call) {
                    trace_[span.job].spans.push_back(span);
                    continue;
                }
                // The last call's upload for this one, still in flight when that call ended.
                if (span.job >= previous_trace.size() || !previous_trace[span.job].next_call)
                    continue; // not one of its uploads: no entry to name it by
                JobTrace entry = previous_trace[span.job];
                entry.job = trace_.size();
                entry.next_call = false;
                entry.from_last_call = true;
                entry.spans = {span};
                trace_.push_back(std::move(entry));
            }
        } catch (...) {
            devices_done = false;
            if (!error)
                error = std::current_exception();
        }
    }
    cursor_ = (cursor_ + num_jobs) % G;
    ctx.state = nullptr;
    if (error) {
        // The next call starts from a clean device.
        carried_.assign(G, std::vector<CarriedWeights>(kCarriedJobs));
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
