#include "options.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace tb {
namespace {

[[noreturn]] void usage(const char *argv0, const std::string &why) {
    std::fprintf(stderr,
                 "%s\nusage: %s [--shape %s] [--batch N] "
                 "[--seq N] [--microbatches N]\n"
                 "  [--grain stage|layer] [--dtype bf16|f16|f32] [--optim-dtype f32|bf16]\n"
                 "  [--steps N] [--warmup N] [--fb-only-steps N] [--opt-steps N]\n"
                 "  [--devices cpu|cuda] [--num-devices N] [--plan auto|N,N,...]\n"
                 "  [--backward-plan auto|N,N,... (with --plan)]\n"
                 "  [--gpu-cap-gib X] [--pin alloc|register|off] [--host-memory standard|saving]\n"
                 "  [--step-in-call on|off (saving mode: the step inside each call)]\n"
                 "  [--lr X] [--seed N]\n"
                 "  [--baseline on|off] [--baseline-steps N] [--baseline-warmup N]\n"
                 "  [--baseline-microbatches N (default: --microbatches)]\n"
                 "  [--trace FILE] [--trace-alone FILE] [--host-check on|off]\n"
                 "  [--check] [--label TEXT] [--data-parallel env|off (torchrun's environment)]\n"
                 "  [--lora RANK (0: full fine-tune)] [--lora-targets all-linear|q_proj,...]\n",
                 why.c_str(), argv0, shape_names().c_str());
    std::exit(2);
}

bool on_off(const char *argv0, const std::string &flag, const std::string &v) {
    if (v == "on")
        return true;
    if (v == "off")
        return false;
    usage(argv0, flag + " takes on or off, got '" + v + "'");
}

// Sets the option `flag` names from `v`; false for an unknown flag. std::stoi and friends
// throw std::logic_error for a bad number.
bool set_option(Options &o, const char *argv0, const std::string &a, const std::string &v) {
    if (a == "--shape") o.shape = v;
    else if (a == "--batch") o.batch = std::stoll(v);
    else if (a == "--seq") o.seq = std::stoll(v);
    else if (a == "--microbatches") o.microbatches = std::stoll(v);
    else if (a == "--grain") o.grain = v;
    else if (a == "--dtype") o.dtype = v;
    else if (a == "--optim-dtype") o.optim_dtype = v;
    else if (a == "--steps") o.steps = std::stoi(v);
    else if (a == "--warmup") o.warmup = std::stoi(v);
    else if (a == "--fb-only-steps") o.fb_only_steps = std::stoi(v);
    else if (a == "--opt-steps") o.opt_steps = std::stoi(v);
    else if (a == "--devices") o.devices = v;
    else if (a == "--num-devices") o.num_devices = std::stoi(v);
    else if (a == "--baseline") o.baseline = on_off(argv0, a, v);
    else if (a == "--baseline-steps") o.baseline_steps = std::stoi(v);
    else if (a == "--baseline-warmup") o.baseline_warmup = std::stoi(v);
    else if (a == "--baseline-microbatches") o.baseline_microbatches = std::stoll(v);
    else if (a == "--trace") o.trace_file = v;
    else if (a == "--trace-alone") o.trace_alone_file = v;
    else if (a == "--plan") o.plan = v;
    else if (a == "--backward-plan") o.backward_plan = v;
    else if (a == "--gpu-cap-gib") o.gpu_cap_gib = std::stod(v);
    else if (a == "--pin") o.pin = v;
    else if (a == "--host-memory") o.host_memory = v;
    else if (a == "--step-in-call") o.step_in_call = on_off(argv0, a, v);
    else if (a == "--lr") o.lr = std::stod(v);
    else if (a == "--seed") o.seed = std::stoull(v);
    else if (a == "--host-check") o.host_check = on_off(argv0, a, v);
    else if (a == "--label") o.label = v;
    else if (a == "--lora") o.lora_rank = std::stoi(v);
    else if (a == "--lora-targets") o.lora_targets = v;
    else if (a == "--data-parallel") {
        if (v != "env" && v != "off")
            usage(argv0, "--data-parallel takes env or off");
        o.data_parallel = v == "env";
    }
    else return false;
    return true;
}

void validate(const Options &o, const char *argv0) {
    if (o.grain != "stage" && o.grain != "layer")
        usage(argv0, "--grain takes stage or layer");
    if (o.dtype != "bf16" && o.dtype != "f16" && o.dtype != "f32")
        usage(argv0, "--dtype takes bf16, f16 or f32");
    if (o.optim_dtype != "f32" && o.optim_dtype != "bf16")
        usage(argv0, "--optim-dtype takes f32 or bf16");
    if (o.devices != "cpu" && o.devices != "cuda")
        usage(argv0, "--devices takes cpu or cuda");
    if (o.step_in_call && o.host_memory != "saving")
        usage(argv0, "--step-in-call needs --host-memory saving");
    if (o.host_memory != "standard" && o.host_memory != "saving")
        usage(argv0, "--host-memory takes standard or saving");
    if (o.pin != "alloc" && o.pin != "register" && o.pin != "off")
        usage(argv0, "--pin takes alloc, register or off");
    if (o.steps < 1 || o.warmup < 0 || o.fb_only_steps < 0 || o.opt_steps < 0)
        usage(argv0, "--steps must be >= 1; --warmup, --fb-only-steps, --opt-steps >= 0");
    if (!find_shape(o.shape))
        usage(argv0, "unknown shape '" + o.shape + "'");
    if (find_shape(o.shape)->moe() && o.baseline)
        usage(argv0, "the plain-PyTorch baseline is a dense Qwen3: give --baseline off with " +
                         o.shape);
}

} // namespace

const Shape &Options::model_shape() const { return *find_shape(shape); }

namespace {

std::vector<int32_t> counts_of(const std::string &list) {
    std::vector<int32_t> counts;
    if (list == "auto")
        return counts;
    std::stringstream ss(list);
    std::string item;
    while (std::getline(ss, item, ','))
        counts.push_back(std::stoi(item));
    return counts;
}

} // namespace

std::vector<int32_t> Options::plan_counts() const { return counts_of(plan); }
std::vector<int32_t> Options::backward_plan_counts() const { return counts_of(backward_plan); }

Options parse_options(int argc, char **argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--check") {
            o.check = true;
            continue;
        }
        if (a == "-h" || a == "--help")
            usage(argv[0], "");
        if (i + 1 >= argc)
            usage(argv[0], "missing value for " + a);
        std::string v = argv[++i];
        try {
            if (!set_option(o, argv[0], a, v))
                usage(argv[0], "unknown flag " + a);
        } catch (const std::logic_error &) {
            usage(argv[0], "bad value '" + v + "' for " + a);
        }
    }
    validate(o, argv[0]);
    const Shape &s = o.model_shape();
    o.batch = o.batch > 0 ? o.batch : s.batch;
    o.seq = o.seq > 0 ? o.seq : s.seq;
    o.microbatches = o.microbatches > 0 ? o.microbatches : s.microbatches;
    return o;
}

} // namespace tb
