#include "roundpipe_run.h"

#include <roundpipe.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>

#include "memory.h"
#include "thread_cpu.h"
#include "tokens.h"
#include "util.h"

namespace tb {
namespace {

struct ModelHandle {
    rp_model *m = nullptr;
    ~ModelHandle() { rp_model_destroy(m); }
};
struct LossHandle {
    rp_loss *l = nullptr;
    ~LossHandle() { rp_loss_destroy(l); }
};
struct OptHandle {
    rp_optimizer *o = nullptr;
    ~OptHandle() { rp_optimizer_destroy(o); }
};
using OptionsPtr = std::unique_ptr<rp_model_options, void (*)(rp_model_options *)>;
using RunConfigPtr = std::unique_ptr<rp_run_config, void (*)(rp_run_config *)>;

int32_t rp_dtype_of(const std::string &d) {
    return d == "bf16" ? RP_DTYPE_BF16 : d == "f16" ? RP_DTYPE_F16 : RP_DTYPE_F32;
}

int32_t rp_pin_of(const std::string &p) {
    return p == "alloc" ? RP_PIN_ALLOC : p == "register" ? RP_PIN_REGISTER : RP_PIN_OFF;
}

// The run configuration: microbatches and recompute grain.
RunConfigPtr run_config(int64_t microbatches, const std::string &grain) {
    rp_run_config *rc = nullptr;
    RP_CHECK(rp_run_config_create(&rc));
    RunConfigPtr guard(rc, rp_run_config_destroy);
    RP_CHECK(rp_run_config_set_num_microbatch(rc, static_cast<int32_t>(microbatches)));
    RP_CHECK(
        rp_run_config_set_recompute_grain(rc, grain == "layer" ? RP_GRAIN_LAYER : RP_GRAIN_STAGE));
    return guard;
}

// What the host state depends on: the dtypes, the host memory mode and LoRA (`with_lora`).
OptionsPtr state_options(const Options &o, const std::string &name, bool with_lora = true) {
    rp_model_options *mo = nullptr;
    RP_CHECK(rp_model_options_create(&mo));
    OptionsPtr guard(mo, rp_model_options_destroy);
    RP_CHECK(rp_model_options_set_model_dtype(mo, rp_dtype_of(o.dtype)));
    RP_CHECK(rp_model_options_set_optim_dtype(mo, rp_dtype_of(o.optim_dtype)));
    RP_CHECK(rp_model_options_set_seed(mo, o.seed));
    RP_CHECK(rp_model_options_set_name(mo, name.c_str()));
    RP_CHECK(rp_model_options_set_host_memory_mode(
        mo, o.host_memory == "saving" ? RP_HOST_MEMORY_SAVING : RP_HOST_MEMORY_STANDARD));
    if (with_lora && o.lora_rank > 0)
        RP_CHECK(rp_model_options_set_lora(mo, o.lora_rank, 2.0 * o.lora_rank, 0.0,
                                           o.lora_targets.c_str()));
    return guard;
}

// The benchmark's model options: everything the command line sets.
OptionsPtr bench_options(const Options &o) {
    OptionsPtr mo = state_options(o, "bench-" + o.shape);
    RP_CHECK(rp_model_options_set_devices(mo.get(), o.on_gpu() ? RP_DEVICE_CUDA : RP_DEVICE_CPU,
                                          o.num_devices));
    RP_CHECK(rp_model_options_set_pin_mode(mo.get(), rp_pin_of(o.pin)));
    if (o.gpu_cap_gib > 0)
        RP_CHECK(rp_model_options_set_gpu_memory_cap(
            mo.get(), static_cast<int64_t>(o.gpu_cap_gib * 1073741824.0)));
    const std::vector<int32_t> plan = o.plan_counts();
    if (!plan.empty())
        RP_CHECK(rp_model_options_set_stage_plan(mo.get(), plan.data(), plan.size()));
    RP_CHECK(rp_model_options_set_run_config(mo.get(), run_config(o.microbatches, o.grain).get()));
    if (o.data_parallel)
        RP_CHECK(rp_model_options_set_data_parallel(mo.get(), -1, -1, "env://", 0));
    return mo;
}

// A model with its loss and optimizer, trained on the token stream both systems share.
struct Session {
    ModelHandle model;
    LossHandle loss;
    OptHandle opt;
    TokenStream stream;
    std::vector<int64_t> ids;
    DlI64 ids_dl, labels_dl; // labels are the ids: token i is scored against token i + 1

    Session(const Options &o, const Shape &s, int64_t batch, int64_t seq)
        : stream(token_stream(o.seed, s.vocab)), ids(static_cast<size_t>(batch * seq)),
          ids_dl(ids.data(), batch, seq), labels_dl(ids.data(), batch, seq) {
        RP_CHECK(rp_loss_create(&loss.l, RP_LOSS_CAUSAL_LM));
        RP_CHECK(rp_optimizer_create(&opt.o, RP_OPTIMIZER_ADAMW));
        RP_CHECK(rp_optimizer_set_learning_rate(opt.o, o.lr));
        RP_CHECK(rp_optimizer_set_weight_decay(opt.o, o.weight_decay));
    }

    void create(const Shape &s, const rp_model_options *mo) {
        RP_CHECK(rp_model_create_from_hf_config(&model.m, hf_config_json(s).c_str(), mo));
    }

    // One forward_backward on the next batch; returns its loss.
    double fb() {
        stream.fill(ids);
        const DLManagedTensor *inputs[1] = {&ids_dl.managed};
        double l = 0;
        RP_CHECK(rp_forward_backward(&l, nullptr, model.m, inputs, 1, &labels_dl.managed, loss.l,
                                     nullptr));
        return l;
    }
    void step(bool async) { RP_CHECK(rp_step(model.m, opt.o, async ? 1 : 0)); }
    // With in-call steps the training call is the step: an iteration's explicit step is
    // nothing (timed all the same: it must cost nothing).
    void iteration_step() {
        if (!in_call)
            step(true);
    }
    void set_step_in_call(bool on) {
        RP_CHECK(rp_model_set_step_in_call(model.m, on ? opt.o : nullptr));
        in_call = on;
    }
    bool in_call = false;
};

void create_model(RoundPipeRun &r, Session &sess, const Options &o) {
    OptionsPtr mo = bench_options(o);
    progress("roundpipe: creating the model (random weights on the host)");
    auto t0 = Clock::now();
    sess.create(o.model_shape(), mo.get());
    const std::vector<int32_t> backward = o.backward_plan_counts();
    if (!backward.empty())
        RP_CHECK(rp_model_set_backward_stage_plan(sess.model.m, backward.data(), backward.size()));
    if (o.step_in_call)
        sess.set_step_in_call(true);
    r.create_ms = round_to(ms_since(t0), 1);
    RP_CHECK(rp_model_num_devices(&r.num_devices, sess.model.m));
    RP_CHECK(rp_model_num_layers(&r.num_layers, sess.model.m));
    RP_CHECK(rp_model_gpu_memory_cap(&r.gpu_memory_cap, sess.model.m));
    RP_CHECK(rp_model_data_parallel(&r.rank, &r.world_size, sess.model.m));
    r.created = true;
}

void warm_up(RoundPipeRun &r, Session &sess, const Options &o) {
    for (int i = 0; i < o.warmup; ++i) {
        auto t0 = Clock::now();
        r.losses.push_back(sess.fb());
        sess.iteration_step();
        progress("roundpipe warm-up " + std::to_string(i + 1) + "/" + std::to_string(o.warmup) +
                 ": " + std::to_string(ms_since(t0)) + " ms, loss " +
                 std::to_string(r.losses.back()));
    }
}

// Steady state: each iteration is forward_backward (the previous step running meanwhile on the
// optimizer thread) plus rp_step, which first waits for that previous step: the time spent
// inside rp_step is the optimizer time the GPU work did not hide.
void timed_loop(RoundPipeRun &r, Session &sess, const Options &o) {
    const std::map<std::string, ThreadCpu> cpu_before = thread_cpu_by_name();
    auto t_loop = Clock::now();
    for (int i = 0; i < o.steps; ++i) {
        auto t0 = Clock::now();
        r.losses.push_back(sess.fb());
        r.fb_ms.push_back(ms_since(t0));
        auto t1 = Clock::now();
        sess.iteration_step();
        r.step_ms.push_back(ms_since(t1));
        progress("roundpipe step " + std::to_string(i + 1) + "/" + std::to_string(o.steps) +
                 ": forward_backward " + std::to_string(r.fb_ms.back()) + " ms, rp_step " +
                 std::to_string(r.step_ms.back()) + " ms, loss " + std::to_string(r.losses.back()));
    }
    r.loop_ms = ms_since(t_loop);
    r.loop_thread_cpu = thread_cpu_between(cpu_before, thread_cpu_by_name(), r.loop_ms);
}

// The timing record of the last call and the plan it ran with (after the engine's re-plan).
void ask_plan_and_trace(RoundPipeRun &r, const Session &sess) {
    const char *text = nullptr;
    RP_CHECK(rp_model_trace_json(&text, sess.model.m));
    r.trace_json = text ? text : "";
    int32_t stages = 0;
    RP_CHECK(rp_model_stage_plan(nullptr, &stages, 0, sess.model.m));
    r.plan.assign(static_cast<size_t>(stages), 0);
    RP_CHECK(rp_model_stage_plan(r.plan.data(), &stages, stages, sess.model.m));
    RP_CHECK(rp_model_backward_stage_plan(nullptr, &stages, 0, sess.model.m));
    r.backward_plan.assign(static_cast<size_t>(stages), 0);
    RP_CHECK(rp_model_backward_stage_plan(r.backward_plan.data(), &stages, stages, sess.model.m));
}

// The same calls without an optimizer step in flight, and the optimizer step alone. Each call
// starts from zeroed gradients, as in the timed loop (one call per step): calls that add to
// earlier gradients take another path in the engine (their contributions are held back until the
// call succeeds). Each timed step follows a call, so it updates every parameter from that call's
// gradients: a step after a step has no gradients, updates nothing and only finishes the weight
// copies, which took half a real step's time (bench/RESULTS.md, round 25, where steps 2 and 3 of
// three in a row had been timed that way). A synchronous rp_step returns once the update, the
// model-dtype copy of the new weights and the gradient reset are done.
void isolated_phases(RoundPipeRun &r, Session &sess, const Options &o) {
    RP_CHECK(rp_synchronize(sess.model.m));
    if (sess.in_call) // the phases apart: the call without its step, then the step alone
        sess.set_step_in_call(false);
    for (int i = 0; i < std::max(o.fb_only_steps, o.opt_steps); ++i) {
        RP_CHECK(rp_zero_grad(sess.model.m));
        auto t0 = Clock::now();
        sess.fb();
        const double fb_ms = ms_since(t0);
        if (i < o.fb_only_steps) {
            r.fb_only_ms.push_back(fb_ms);
            const char *text = nullptr; // what the timed call's trace is compared with
            RP_CHECK(rp_model_trace_json(&text, sess.model.m));
            r.trace_alone_json = text ? text : "";
            progress("roundpipe forward_backward alone " + std::to_string(i + 1) + "/" +
                     std::to_string(o.fb_only_steps) + ": " + std::to_string(fb_ms) + " ms");
        }
        if (i < o.opt_steps) {
            auto t1 = Clock::now();
            sess.step(false);
            r.opt_ms.push_back(ms_since(t1));
            progress("roundpipe optimizer step alone " + std::to_string(i + 1) + "/" +
                     std::to_string(o.opt_steps) + ": " + std::to_string(r.opt_ms.back()) + " ms");
        }
    }
    RP_CHECK(rp_synchronize(sess.model.m));
}

void write_trace(const std::string &file, const std::string &text) {
    std::ofstream f(file);
    f << text;
    if (!f)
        throw BenchError("cannot write the trace to " + file);
}

} // namespace

void run_roundpipe(RoundPipeRun &r, const Options &o, int num_gpus) {
    const bool on_gpu = o.on_gpu();
    Session sess(o, o.model_shape(), o.batch, o.seq);
    create_model(r, sess, o);
    if (on_gpu)
        gpu_reset_peak(num_gpus);
    warm_up(r, sess, o);
    r.peak_gpu_warmup = on_gpu ? gpu_peak(num_gpus) : -1;
    if (on_gpu)
        gpu_reset_peak(num_gpus);
    timed_loop(r, sess, o);
    r.peak_gpu_steady = on_gpu ? gpu_peak(num_gpus) : -1;
    ask_plan_and_trace(r, sess);
    isolated_phases(r, sess, o);
    r.peak_rss = peak_rss_bytes();
    RP_CHECK(rp_model_host_state_bytes(&r.host_state_bytes, &r.host_state_elements, sess.model.m));
    if (!o.trace_file.empty())
        write_trace(o.trace_file, r.trace_json);
    if (!o.trace_alone_file.empty())
        write_trace(o.trace_alone_file, r.trace_alone_json);
    r.finished = true;
    for (double l : r.losses)
        if (!std::isfinite(l))
            throw BenchError("RoundPipe loss is not finite: " + std::to_string(l));
}

namespace {

// rp_model_host_state_bytes of a tiny model after one training step on a CPU device, and the
// elements of its trainable parameters (the adapters under LoRA), as the engine reports them.
struct HostProbe {
    int64_t bytes = 0, elements = 0, trainable = 0;
};

HostProbe probe_host_state(const Options &o, bool with_lora) {
    const Shape &tiny = *find_shape("tiny");
    OptionsPtr mo = state_options(o, "bench-host-probe", with_lora);
    RP_CHECK(rp_model_options_set_devices(mo.get(), RP_DEVICE_CPU, 1));
    RP_CHECK(rp_model_options_set_grad_scaler(mo.get(), 0.0, 1)); // no skipped step (f16)
    RP_CHECK(rp_model_options_set_run_config(mo.get(), run_config(1, "stage").get()));
    Session sess(o, tiny, 1, 8);
    sess.create(tiny, mo.get());
    sess.fb();
    sess.step(false);
    RP_CHECK(rp_synchronize(sess.model.m));
    HostProbe p;
    RP_CHECK(rp_model_host_state_bytes(&p.bytes, &p.elements, sess.model.m));
    if (p.elements <= 0)
        throw BenchError("rp_model_host_state_bytes counted no parameters");
    size_t count = 0;
    RP_CHECK(rp_param_count(&count, sess.model.m));
    for (size_t i = 0; i < count; ++i) {
        int32_t kind = 0, ndim = 0;
        int64_t shape[8];
        RP_CHECK(rp_param_kind_of(&kind, sess.model.m, i));
        RP_CHECK(rp_param_shape(shape, &ndim, 8, sess.model.m, i));
        int64_t n = 1;
        for (int32_t d = 0; d < ndim; ++d)
            n *= shape[d];
        if (kind == RP_PARAM_TRAINABLE)
            p.trainable += n;
    }
    return p;
}

} // namespace

HostBytesPerParam engine_host_bytes_per_param(const Options &o) {
    const HostProbe full = probe_host_state(o, false);
    HostBytesPerParam per;
    per.trainable = static_cast<double>(full.bytes) / static_cast<double>(full.elements);
    per.frozen = per.trainable;
    if (o.lora_rank > 0) {
        // Adapters cost what any trainable parameter costs; the rest is what frozen ones do.
        const HostProbe lora = probe_host_state(o, true);
        per.frozen = (static_cast<double>(lora.bytes) -
                      per.trainable * static_cast<double>(lora.trainable)) /
                     static_cast<double>(lora.elements - lora.trainable);
    }
    return per;
}

} // namespace tb
