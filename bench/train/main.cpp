// train_bench: trains a Qwen3-shaped causal LM (random weights, random tokens) with RoundPipe
// through its C API and, in the same process, with a plain libtorch loop (everything on one
// device, bf16 autocast over fp32 weights, fused AdamW), and prints one JSON line.
//
//   train_bench --shape qwen3-1.7b --batch 8 --seq 4096 --microbatches 4 --dtype bf16
//               --devices cuda --steps 8 --warmup 3 --trace trace.json
//
// bench/RESULTS.md explains every field of the JSON line and how each figure is computed.
// Progress goes to stderr; the JSON line (and nothing else) to stdout.
//
// The pieces: options (command line), shape (model shapes and counts), baseline (libtorch),
// roundpipe_run (the engine through the C API), trace_analysis (its timing record), thread_cpu
// (CPU time per thread name), report (the JSON line), memory and util (helpers).
#include <roundpipe.h>

#include <cstdio>

#include "baseline.h"
#include "memory.h"
#include "options.h"
#include "report.h"
#include "roundpipe_run.h"
#include "util.h"

namespace {

using namespace tb;

// Whether the engine's host state fits in MemAvailable (the bytes per parameter are the
// engine's own, from a tiny model with the same options); reports the estimate either way.
bool host_state_fits(json &out, const Options &o) {
    const HostBytesPerParam per = engine_host_bytes_per_param(o);
    const Shape &s = o.model_shape();
    // Under LoRA the shape's parameters are frozen and the adapters are the trainable ones.
    const double adapters = double(lora_params(s, o.lora_rank, o.lora_targets));
    const double need = o.lora_rank > 0
                            ? per.frozen * double(total_params(s)) + per.trainable * adapters
                            : per.trainable * double(total_params(s));
    const double per_param = need / (double(total_params(s)) + adapters);
    const int64_t avail = mem_available_bytes();
    report_host_memory(out, need, avail);
    if (!o.host_check || avail <= 0 || need <= 0.95 * double(avail))
        return true;
    report_host_skip(out, per_param, need, avail);
    return false;
}

// The baseline first: an explicit GPU memory cap given to RoundPipe limits the whole process's
// allocator, and the baseline's cached blocks are given back before RoundPipe sizes its cap
// from the free memory. Then RoundPipe; its fields are reported as far as it got.
void run_both(json &out, const Options &o, int gpus, RoundPipeRun &run) {
    if (o.baseline)
        report_baseline(out, o, run_baseline(o, gpus));
    else
        out["baseline_status"] = "off";
    out["host_rss_reset"] = reset_peak_rss();
    try {
        run_roundpipe(run, o, gpus);
    } catch (...) {
        report_roundpipe(out, o, run);
        throw;
    }
    report_roundpipe(out, o, run);
    report_ratio(out);
}

} // namespace

int main(int argc, char **argv) {
    const Options o = parse_options(argc, argv);
    json out = report_header(o);
    int exit_code = 0;
    try {
        int32_t gpus = 0;
        RP_CHECK(rp_cuda_device_count(&gpus));
        out["visible_gpus"] = gpus;
        if (o.on_gpu() && gpus == 0)
            throw BenchError("--devices cuda but no GPU is visible");
        // Skip (rather than be killed) when the engine's host state cannot fit.
        if (!host_state_fits(out, o)) {
            std::printf("%s\n", out.dump().c_str());
            return 0;
        }
        RoundPipeRun run;
        run_both(out, o, gpus, run);
        if (o.check && !report_checks(out, o, run))
            exit_code = 1;
    } catch (const std::exception &e) {
        out["status"] = "error";
        out["error"] = e.what();
        exit_code = 1;
    }
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
    return exit_code;
}
