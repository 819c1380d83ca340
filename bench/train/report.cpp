#include "report.h"

#include <algorithm>
#include <cmath>
#include <string>

#include <ATen/Parallel.h>

#include "shape.h"
#include "trace_analysis.h"

namespace tb {
namespace {

json bytes_or_null(bool present, int64_t v) { return present ? json(v) : json(nullptr); }

void report_creation(json &out, const RoundPipeRun &r) {
    out["create_ms"] = r.create_ms;
    out["num_devices"] = r.num_devices;
    out["data_parallel"] = {{"rank", r.rank}, {"world_size", r.world_size}};
    out["gpu_memory_cap_bytes"] = r.gpu_memory_cap;
}

// Throughput and FLOPs of the timed loop.
void report_throughput(json &out, const Options &o, const RoundPipeRun &r) {
    const Shape &s = o.model_shape();
    const double iter_ms = r.loop_ms / o.steps, secs = r.loop_ms / 1000.0;
    const double n_tok = static_cast<double>(o.tokens()) * o.steps;
    const double fp = static_cast<double>(flop_params(s));
    const double attn = attention_forward_flops(s, o.batch, o.seq);
    out["stages"] = r.plan.size();
    out["tokens_per_s"] = round_to(n_tok / secs, 1);
    out["iter_ms"] = round_to(iter_ms, 3);
    out["fb_ms"] = round_to(mean(r.fb_ms), 3);
    out["loop_thread_cpu"] = r.loop_thread_cpu;
    out["model_tflops"] = round_to(6.0 * fp * n_tok / secs / 1e12, 3);
    out["hw_tflops"] = round_to((8.0 * fp * o.tokens() + 4.0 * attn) * o.steps / secs / 1e12, 3);
    out["attention_flops_per_iter"] = 4.0 * attn;
}

void report_memory(json &out, const Options &o, const RoundPipeRun &r) {
    const bool gpu = o.on_gpu();
    out["peak_gpu_bytes"] = bytes_or_null(gpu, std::max(r.peak_gpu_warmup, r.peak_gpu_steady));
    out["peak_gpu_steady_bytes"] = bytes_or_null(gpu, r.peak_gpu_steady);
    out["peak_host_rss_bytes"] = r.peak_rss;
    out["host_bytes_per_param"] =
        round_to(double(r.peak_rss) / double(total_params(o.model_shape())), 3);
    out["host_state_bytes"] = r.host_state_bytes;
    out["host_state_bytes_per_param"] =
        round_to(double(r.host_state_bytes) / double(r.host_state_elements), 3);
}

// Bytes each way in the last timed forward_backward, from the trace's transfer events, and the
// plan the engine ran it with.
void report_pcie(json &out, const Options &o, const RoundPipeRun &r, const Trace &trace) {
    const PcieBytes p = pcie_bytes(trace);
    const double fb_last_ms = r.fb_ms.back();
    out["pcie_method"] = "trace-bytes";
    out["pcie_plan"] = r.plan;
    out["backward_plan"] = r.backward_plan;
    out["pcie_h2d_bytes_per_iter"] = p.h2d();
    out["pcie_d2h_bytes_per_iter"] = p.d2h();
    out["pcie_h2d_weight_bytes"] = p.h2d_weights;
    out["pcie_h2d_activation_bytes"] = p.h2d_activations;
    out["pcie_d2h_grad_bytes"] = p.d2h_grads;
    out["pcie_d2h_activation_bytes"] = p.d2h_activations;
    auto gbps = [&](double bytes, double ms) {
        return o.on_gpu() && ms > 0 ? json(round_to(bytes / ms / 1e6, 3)) : json(nullptr);
    };
    out["pcie_h2d_gbps_busy"] = gbps(p.h2d(), p.h2d_busy_ms);
    out["pcie_d2h_gbps_busy"] = gbps(p.d2h(), p.d2h_busy_ms);
    out["pcie_h2d_gbps_avg"] = gbps(p.h2d(), fb_last_ms);
    out["pcie_d2h_gbps_avg"] = gbps(p.d2h(), fb_last_ms);
    out["pcie_devices"] = o.on_gpu() ? p.per_device : json(nullptr);
}

// Per-device overlap, and the host time of the last forward_backward outside its device
// timeline: input checks and splitting before the first span, gradient accumulation into the
// fp32 host gradients and the loss read-back after the last one (the GPUs idle then, unless
// another call overlaps).
void report_trace(json &out, const RoundPipeRun &r, const Trace &trace) {
    out["trace_devices"] = trace_devices(trace);
    const double end = trace_end_ms(trace);
    out["trace_window_ms"] = round_to(end, 3);
    out["fb_outside_trace_ms"] = round_to(r.fb_ms.back() - end, 3);
}

void report_optimizer(json &out, const Options &o, const RoundPipeRun &r) {
    const double iter_ms = r.loop_ms / o.steps;
    const double opt_step = median(r.opt_ms), fb_alone = median(r.fb_only_ms);
    const double exposed = mean(r.step_ms);
    out["opt_step_ms"] = num_or_null(round_to(opt_step, 3));
    out["opt_exposed_ms"] = round_to(exposed, 3);
    out["fb_only_ms"] = num_or_null(round_to(fb_alone, 3));
    auto clamp01 = [](double v) { return std::min(1.0, std::max(0.0, v)); };
    out["opt_hidden_fraction"] =
        std::isfinite(opt_step) && std::isfinite(fb_alone) && opt_step > 0
            ? json(round_to(clamp01(1.0 - std::max(0.0, iter_ms - fb_alone) / opt_step), 4))
            : json(nullptr);
    out["opt_hidden_fraction_blocking"] =
        std::isfinite(opt_step) && opt_step > 0
            ? json(round_to(clamp01(1.0 - exposed / opt_step), 4))
            : json(nullptr);
}

bool is_number(const json &out, const char *key) {
    return out.contains(key) && out[key].is_number();
}

// The plan the engine reports covers its layer list, and is the explicit one when --plan gave it.
bool plan_consistent(const Options &o, const RoundPipeRun &r) {
    int64_t layers = 0;
    for (int32_t c : r.plan)
        layers += c;
    const std::vector<int32_t> asked = o.plan_counts();
    const std::vector<int32_t> backward = o.backward_plan_counts();
    return !r.plan.empty() && layers == r.num_layers && (asked.empty() || asked == r.plan) &&
           (backward.empty() ? r.backward_plan == r.plan : backward == r.backward_plan);
}

} // namespace

json report_header(const Options &o) {
    const Shape &s = o.model_shape();
    json out;
    out["bench"] = "train";
    out["status"] = "ok";
    out["label"] = o.label;
    out["roundpipe_version"] = rp_version();
    out["shape"] = s.name;
    out["params"] = total_params(s);
    out["lora_rank"] = o.lora_rank;
    if (o.lora_rank > 0) {
        out["lora_targets"] = o.lora_targets;
        out["lora_params"] = lora_params(s, o.lora_rank, o.lora_targets);
    }
    out["flop_params"] = flop_params(s);
    out["batch"] = o.batch;
    out["seq"] = o.seq;
    out["tokens_per_iter"] = o.tokens();
    out["microbatches"] = o.microbatches;
    out["grain"] = o.grain;
    out["dtype"] = o.dtype;
    out["optim_dtype"] = o.optim_dtype;
    out["devices"] = o.devices;
    out["plan"] = o.plan;
    out["backward_plan_asked"] = o.backward_plan;
    out["gpu_cap_gib"] = o.gpu_cap_gib;
    out["pin"] = o.pin;
    out["host_memory"] = o.host_memory;
    out["step_in_call"] = o.step_in_call;
    out["steps"] = o.steps;
    out["warmup"] = o.warmup;
    out["host_threads"] = at::get_num_threads();
    return out;
}

void report_host_memory(json &out, double need, int64_t available) {
    out["host_bytes_estimate"] = need;
    out["host_mem_available_bytes"] = available;
}

void report_host_skip(json &out, double bytes_per_param, double need, int64_t available) {
    out["status"] = "skipped";
    out["reason"] = "the engine's host state needs about " + std::to_string(need / 1073741824.0) +
                    " GiB (" + std::to_string(bytes_per_param) + " bytes/parameter), only " +
                    std::to_string(available / 1073741824.0) +
                    " GiB available; --host-check off to try anyway";
}

void report_baseline(json &out, const Options &o, const BaselineResult &b) {
    out["baseline_microbatches"] = b.microbatches;
    if (b.bytes_estimate)
        out["baseline_bytes_estimate"] = *b.bytes_estimate;
    if (b.params)
        out["baseline_params"] = *b.params;
    out["baseline_status"] = b.status;
    if (b.status == "ok") {
        out["baseline_mode"] = b.mode;
        out["baseline_steps"] = b.steps;
        out["baseline_iter_ms"] = b.iter_ms;
        out["baseline_tokens_per_s"] = b.tokens_per_s;
    }
    if (b.has_peak)
        out["baseline_peak_gpu_bytes"] = bytes_or_null(o.on_gpu(), b.peak_gpu_bytes);
    if (b.status == "ok") {
        out["baseline_loss_first"] = b.loss_first;
        out["baseline_loss_last"] = b.loss_last;
    }
}

void report_roundpipe(json &out, const Options &o, const RoundPipeRun &r) {
    if (r.created)
        report_creation(out, r);
    if (!r.finished)
        return;
    report_throughput(out, o, r);
    report_memory(out, o, r);
    const Trace trace = parse_trace(r.trace_json);
    report_pcie(out, o, r, trace);
    report_trace(out, r, trace);
    report_optimizer(out, o, r);
    out["loss_first"] = r.losses.front();
    out["loss_last"] = r.losses.back();
}

void report_ratio(json &out) {
    if (is_number(out, "baseline_tokens_per_s"))
        out["ratio_vs_baseline"] = round_to(out["tokens_per_s"].get<double>() /
                                                out["baseline_tokens_per_s"].get<double>(),
                                            4);
    else
        out["ratio_vs_baseline"] = nullptr;
}

// Random weights at std 0.02 give a first loss near ln(vocab) in both systems, and every
// figure that must exist does.
bool report_checks(json &out, const Options &o, const RoundPipeRun &r) {
    const double ln_v = std::log(static_cast<double>(o.model_shape().vocab));
    auto near = [&](const char *key) {
        return is_number(out, key) && std::fabs(out[key].get<double>() - ln_v) < 1.0;
    };
    std::string failed;
    if (!near("loss_first"))
        failed += " loss_first";
    if (o.baseline && !near("baseline_loss_first"))
        failed += " baseline_loss_first";
    if (!(out["tokens_per_s"].get<double>() > 0))
        failed += " tokens_per_s";
    if (o.baseline && !out["ratio_vs_baseline"].is_number())
        failed += " ratio_vs_baseline";
    if (!plan_consistent(o, r))
        failed += " pcie_plan";
    // CPU devices record compute only: no transfer, no bytes.
    if (o.on_gpu() && !(out["pcie_h2d_bytes_per_iter"].get<double>() > 0))
        failed += " pcie_h2d_bytes_per_iter";
    const double estimate = out["host_bytes_estimate"].get<double>();
    if (std::fabs(estimate - out["host_state_bytes"].get<double>()) > 0.01 * estimate)
        failed += " host_bytes_estimate";
    if (!out["opt_hidden_fraction"].is_number())
        failed += " opt_hidden_fraction";
    if (failed.empty())
        return true;
    out["status"] = "check failed:" + failed;
    return false;
}

} // namespace tb
