// train_bench: trains a Qwen3-shaped causal LM (random weights, random tokens) with RoundPipe
// through its C API and, in the same process, with a plain libtorch loop (everything on one
// device, bf16 autocast over fp32 weights, fused AdamW), and prints one JSON line.
//
//   train_bench --shape qwen3-1.7b --batch 8 --seq 4096 --microbatches 4 --dtype bf16
//               --devices cuda --steps 8 --warmup 3 --trace trace.json
//
// bench/RESULTS.md explains every field of the JSON line and how each figure is computed.
// Progress goes to stderr; the JSON line (and nothing else) to stdout.
#include <roundpipe.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Reduction.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <nlohmann/json.hpp>

namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void progress(const std::string &msg) {
    std::fprintf(stderr, "[train_bench] %s\n", msg.c_str());
    std::fflush(stderr);
}

struct BenchError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

void check(rp_status s, const char *what) {
    if (s != RP_OK)
        throw BenchError(std::string(what) + " failed: " + rp_status_string(s) + ": " +
                         rp_last_error_message());
}
#define RP_CHECK(call) check((call), #call)

// ---------------------------------------------------------------------------------------------
// Model shapes (public config.json of each Qwen3 model; `tiny` for CPU smoke runs).
// ---------------------------------------------------------------------------------------------
struct Shape {
    std::string name;
    int64_t hidden, layers, heads, kv_heads, head_dim, intermediate, vocab;
    bool tied;
    // Defaults used when --batch/--seq/--microbatches are not given.
    int64_t batch, seq, microbatches;
};

const std::vector<Shape> kShapes = {
    {"tiny", 64, 4, 4, 2, 16, 192, 512, true, 4, 64, 2},
    {"qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151936, true, 8, 4096, 4},
    {"qwen3-1.7b", 2048, 28, 16, 8, 128, 6144, 151936, true, 8, 4096, 4},
    {"qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, false, 8, 4096, 4},
};

int64_t decoder_layer_params(const Shape &s) {
    const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
    return q * s.hidden + 2 * kv * s.hidden + s.hidden * q + 2 * s.head_dim +
           3 * s.hidden * s.intermediate + 2 * s.hidden;
}

// Every parameter with a master weight of its own (the tied LM head counts once).
int64_t total_params(const Shape &s) {
    return s.vocab * s.hidden + s.layers * decoder_layer_params(s) + s.hidden +
           (s.tied ? 0 : s.vocab * s.hidden);
}

// Parameters that take part in a matrix multiply per token: all but the input embedding table,
// which is a gather, unless it is tied to the LM head (then it is the LM head's matmul).
int64_t flop_params(const Shape &s) {
    return total_params(s) - (s.tied ? 0 : s.vocab * s.hidden);
}

std::string hf_config_json(const Shape &s) {
    json c;
    c["architectures"] = json::array({"Qwen3ForCausalLM"});
    c["model_type"] = "qwen3";
    c["vocab_size"] = s.vocab;
    c["hidden_size"] = s.hidden;
    c["intermediate_size"] = s.intermediate;
    c["num_hidden_layers"] = s.layers;
    c["num_attention_heads"] = s.heads;
    c["num_key_value_heads"] = s.kv_heads;
    c["head_dim"] = s.head_dim;
    c["hidden_act"] = "silu";
    c["max_position_embeddings"] = 40960;
    c["rms_norm_eps"] = 1e-6;
    c["rope_theta"] = 1000000.0;
    c["tie_word_embeddings"] = s.tied;
    c["use_sliding_window"] = false;
    c["attention_bias"] = false;
    c["attention_dropout"] = 0.0;
    c["initializer_range"] = 0.02;
    c["torch_dtype"] = "bfloat16";
    return c.dump();
}

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------
struct Options {
    std::string shape = "tiny";
    int64_t batch = -1, seq = -1, microbatches = -1;
    std::string grain = "stage";
    std::string dtype = "bf16";
    std::string optim_dtype = "f32";
    int steps = 8, warmup = 3;
    int fb_only_steps = 2, opt_steps = 2;
    std::string devices = "cuda";
    int num_devices = 0;
    bool baseline = true;
    int baseline_steps = -1, baseline_warmup = 2;
    int64_t baseline_microbatches = -1; // default: --microbatches
    std::string trace_file;
    std::string plan = "auto"; // auto | comma-separated layers per stage
    double gpu_cap_gib = 0;
    std::string pin = "alloc";
    std::string host_memory = "standard";
    double lr = 1e-4, weight_decay = 0.01;
    uint64_t seed = 1;
    bool host_check = true;
    double host_bytes_per_param = 0; // 0: the current engine's figure
    bool check = false;
    std::string label;
};

[[noreturn]] void usage(const char *argv0, const std::string &why) {
    std::fprintf(stderr,
                 "%s\nusage: %s [--shape tiny|qwen3-0.6b|qwen3-1.7b|qwen3-8b] [--batch N] "
                 "[--seq N] [--microbatches N]\n"
                 "  [--grain stage|layer] [--dtype bf16|f16|f32] [--optim-dtype f32|bf16]\n"
                 "  [--steps N] [--warmup N] [--fb-only-steps N] [--opt-steps N]\n"
                 "  [--devices cpu|cuda] [--num-devices N] [--plan auto|N,N,...]\n"
                 "  [--gpu-cap-gib X] [--pin alloc|register|off] [--host-memory standard|saving]\n"
                 "  [--lr X] [--seed N]\n"
                 "  [--baseline on|off] [--baseline-steps N] [--baseline-warmup N]\n"
                 "  [--baseline-microbatches N (default: --microbatches)]\n"
                 "  [--trace FILE] [--host-check on|off] [--host-bytes-per-param X]\n"
                 "  [--check] [--label TEXT]\n",
                 why.c_str(), argv0);
    std::exit(2);
}

bool on_off(const char *argv0, const std::string &flag, const std::string &v) {
    if (v == "on")
        return true;
    if (v == "off")
        return false;
    usage(argv0, flag + " takes on or off, got '" + v + "'");
}

Options parse(int argc, char **argv) {
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
            else if (a == "--baseline") o.baseline = on_off(argv[0], a, v);
            else if (a == "--baseline-steps") o.baseline_steps = std::stoi(v);
            else if (a == "--baseline-warmup") o.baseline_warmup = std::stoi(v);
            else if (a == "--baseline-microbatches") o.baseline_microbatches = std::stoll(v);
            else if (a == "--trace") o.trace_file = v;
            else if (a == "--plan") o.plan = v;
            else if (a == "--gpu-cap-gib") o.gpu_cap_gib = std::stod(v);
            else if (a == "--pin") o.pin = v;
            else if (a == "--host-memory") o.host_memory = v;
            else if (a == "--lr") o.lr = std::stod(v);
            else if (a == "--seed") o.seed = std::stoull(v);
            else if (a == "--host-check") o.host_check = on_off(argv[0], a, v);
            else if (a == "--host-bytes-per-param") o.host_bytes_per_param = std::stod(v);
            else if (a == "--label") o.label = v;
            else usage(argv[0], "unknown flag " + a);
        } catch (const std::logic_error &) {
            usage(argv[0], "bad value '" + v + "' for " + a);
        }
    }
    if (o.grain != "stage" && o.grain != "layer")
        usage(argv[0], "--grain takes stage or layer");
    if (o.dtype != "bf16" && o.dtype != "f16" && o.dtype != "f32")
        usage(argv[0], "--dtype takes bf16, f16 or f32");
    if (o.optim_dtype != "f32" && o.optim_dtype != "bf16")
        usage(argv[0], "--optim-dtype takes f32 or bf16");
    if (o.devices != "cpu" && o.devices != "cuda")
        usage(argv[0], "--devices takes cpu or cuda");
    if (o.host_memory != "standard" && o.host_memory != "saving")
        usage(argv[0], "--host-memory takes standard or saving");
    if (o.pin != "alloc" && o.pin != "register" && o.pin != "off")
        usage(argv[0], "--pin takes alloc, register or off");
    if (o.steps < 1 || o.warmup < 0 || o.fb_only_steps < 0 || o.opt_steps < 0)
        usage(argv[0], "--steps must be >= 1; --warmup, --fb-only-steps, --opt-steps >= 0");
    return o;
}

int32_t rp_dtype_of(const std::string &d) {
    return d == "bf16" ? RP_DTYPE_BF16 : d == "f16" ? RP_DTYPE_F16 : RP_DTYPE_F32;
}
int64_t dtype_bytes(const std::string &d) { return d == "f32" ? 4 : 2; }

// ---------------------------------------------------------------------------------------------
// Host memory
// ---------------------------------------------------------------------------------------------
int64_t ru_maxrss_bytes() {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return static_cast<int64_t>(ru.ru_maxrss) * 1024; // KiB on Linux
}

// A field of /proc/self/status or /proc/meminfo in bytes ("VmHWM:", "MemAvailable:"); -1 if absent.
int64_t proc_kib_field(const char *file, const char *key) {
    std::ifstream f(file);
    std::string line;
    while (std::getline(f, line))
        if (line.rfind(key, 0) == 0)
            return std::stoll(line.substr(std::strlen(key))) * 1024;
    return -1;
}

// Restart the kernel's peak-RSS mark (Linux >= 4.0), so the RoundPipe phase reports its own
// peak and not the baseline's. Best effort.
bool reset_peak_rss() {
    FILE *f = std::fopen("/proc/self/clear_refs", "w");
    if (!f)
        return false;
    bool ok = std::fputs("5", f) >= 0;
    return std::fclose(f) == 0 && ok;
}

int64_t peak_rss_bytes() {
    int64_t hwm = proc_kib_field("/proc/self/status", "VmHWM:");
    return hwm > 0 ? hwm : ru_maxrss_bytes();
}

// ---------------------------------------------------------------------------------------------
// Random tokens: one batch per step from a seeded generator, the same for both systems.
// ---------------------------------------------------------------------------------------------
struct TokenStream {
    uint64_t state;
    int64_t vocab;
    uint64_t next() { // splitmix64
        uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }
    void fill(std::vector<int64_t> &ids) {
        for (int64_t &t : ids)
            t = static_cast<int64_t>(next() % static_cast<uint64_t>(vocab));
    }
};

// A borrowed DLPack view of a caller-owned int64 array [batch, seq].
struct DlI64 {
    DLManagedTensor managed{};
    int64_t shape[2];
    DlI64(int64_t *data, int64_t b, int64_t t) {
        shape[0] = b;
        shape[1] = t;
        managed.dl_tensor.data = data;
        managed.dl_tensor.device = {kDLCPU, 0};
        managed.dl_tensor.ndim = 2;
        managed.dl_tensor.dtype = {kDLInt, 64, 1};
        managed.dl_tensor.shape = shape;
        managed.dl_tensor.strides = nullptr;
        managed.dl_tensor.byte_offset = 0;
        managed.manager_ctx = nullptr;
        managed.deleter = nullptr;
    }
    DlI64(const DlI64 &) = delete;
};

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

json num_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }
double round_to(double v, int digits) {
    double f = std::pow(10.0, digits);
    return std::round(v * f) / f;
}

// ---------------------------------------------------------------------------------------------
// FLOPs. Attention: QK^T and AV of a causal sequence touch T^2/2 query-key pairs per head,
// 2 multiply-adds of head_dim each: forward 2 * T^2 * heads * head_dim flops per layer and
// sequence; backward twice the forward; recompute once more.
// ---------------------------------------------------------------------------------------------
double attention_forward_flops(const Shape &s, int64_t batch, int64_t seq) {
    return 2.0 * static_cast<double>(seq) * seq * s.heads * s.head_dim * s.layers * batch;
}

// ---------------------------------------------------------------------------------------------
// The timing record: jobs, spans, and the bytes that crossed PCIe.
// ---------------------------------------------------------------------------------------------
struct Span {
    double start, end; // ms
};

struct TraceJob {
    size_t job = 0, stage = 0, device = 0;
    std::string kind;
    std::map<std::string, std::vector<Span>> spans; // by stream
    std::map<std::string, double> bytes;            // by stream, when the trace carries them
};

struct Trace {
    std::map<size_t, TraceJob> jobs;
    bool has_bytes = true; // every transfer event carries args.bytes
    bool has_transfers = false;
};

Trace parse_trace(const std::string &text) {
    Trace t;
    json j = json::parse(text);
    for (const json &e : j.at("traceEvents")) {
        // Device events carry the job in args; metadata and host spans (pid 1000) do not.
        if (e.value("ph", "") != "X" || !e.contains("args") || !e.at("args").contains("job"))
            continue;
        const json &args = e.at("args");
        size_t id = args.at("job").get<size_t>();
        TraceJob &job = t.jobs[id];
        job.job = id;
        job.stage = args.at("stage").get<size_t>();
        job.kind = args.at("kind").get<std::string>();
        job.device = e.at("pid").get<size_t>();
        std::string tid = e.at("tid").get<std::string>();
        double ts = e.at("ts").get<double>() / 1000.0, dur = e.at("dur").get<double>() / 1000.0;
        job.spans[tid].push_back({ts, ts + dur});
        if (tid != "compute") {
            t.has_transfers = true;
            if (args.contains("bytes"))
                job.bytes[tid] += args.at("bytes").get<double>();
            else
                t.has_bytes = false;
        }
    }
    if (!t.has_transfers)
        t.has_bytes = false;
    return t;
}

std::vector<Span> union_of(std::vector<Span> v) {
    std::sort(v.begin(), v.end(), [](const Span &a, const Span &b) { return a.start < b.start; });
    std::vector<Span> out;
    for (const Span &s : v) {
        if (!out.empty() && s.start <= out.back().end)
            out.back().end = std::max(out.back().end, s.end);
        else
            out.push_back(s);
    }
    return out;
}
double length_of(const std::vector<Span> &merged) {
    double t = 0;
    for (const Span &s : merged)
        t += s.end - s.start;
    return t;
}
double overlap_with(const Span &s, const std::vector<Span> &merged) {
    double t = 0;
    for (const Span &m : merged)
        t += std::max(0.0, std::min(s.end, m.end) - std::max(s.start, m.start));
    return t;
}

// Per-layer weight bytes in the model dtype, from the parameter names ("<layer>.<name>"); the
// tied LM head (last layer) uploads the embedding again, so it is counted there too.
std::vector<double> layer_weight_bytes(rp_model *model, const Shape &s, int64_t elt) {
    const size_t num_layers = static_cast<size_t>(s.layers + 3);
    std::vector<double> bytes(num_layers, 0.0);
    size_t count = 0;
    RP_CHECK(rp_param_count(&count, model));
    for (size_t i = 0; i < count; ++i) {
        const char *name = nullptr;
        RP_CHECK(rp_param_name(&name, model, i));
        int64_t shape[8];
        int32_t ndim = 0;
        RP_CHECK(rp_param_shape(shape, &ndim, 8, model, i));
        double n = 1;
        for (int32_t d = 0; d < ndim; ++d)
            n *= static_cast<double>(shape[d]);
        size_t layer = std::stoul(name);
        if (layer < num_layers)
            bytes[layer] += n * elt;
    }
    if (s.tied)
        bytes[num_layers - 1] += bytes[0];
    return bytes;
}

// The stages' layer counts that best explain the measured weight-upload times: contiguous
// ranges whose bytes are proportional to each stage's mean upload time (least squares, by
// dynamic programming). Uploads share one link at one rate, so this recovers the plan the
// engine chose after re-planning; a wrong guess moves at most a layer between neighbours.
std::vector<int> infer_plan(const std::vector<double> &layer_bytes,
                            const std::vector<double> &stage_ms) {
    const size_t L = layer_bytes.size(), S = stage_ms.size();
    if (S == 0 || S > L)
        return {};
    std::vector<double> prefix(L + 1, 0.0);
    for (size_t l = 0; l < L; ++l)
        prefix[l + 1] = prefix[l] + layer_bytes[l];
    double total_ms = 0;
    for (double d : stage_ms)
        total_ms += d;
    if (!(total_ms > 0))
        return {};
    const double rate = prefix[L] / total_ms;
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(S + 1, std::vector<double>(L + 1, inf));
    std::vector<std::vector<size_t>> cut(S + 1, std::vector<size_t>(L + 1, 0));
    best[0][0] = 0;
    for (size_t s = 1; s <= S; ++s)
        for (size_t i = s; i <= L; ++i)
            for (size_t j = s - 1; j < i; ++j) {
                if (best[s - 1][j] == inf)
                    continue;
                double e = (prefix[i] - prefix[j]) - rate * stage_ms[s - 1];
                double c = best[s - 1][j] + e * e;
                if (c < best[s][i]) {
                    best[s][i] = c;
                    cut[s][i] = j;
                }
            }
    std::vector<int> plan(S);
    size_t end = L;
    for (size_t s = S; s >= 1; --s) {
        plan[s - 1] = static_cast<int>(end - cut[s][end]);
        end = cut[s][end];
    }
    return plan;
}

struct PcieResult {
    std::string method; // "trace-bytes", "explicit-plan", "inferred-plan", or why unavailable
    std::vector<int> plan;
    double h2d_weights = NAN, h2d_activations = NAN, d2h_grads = NAN, d2h_activations = NAN;
    double h2d_busy_ms = 0, d2h_busy_ms = 0;
    json per_device = json::array();
};

// Bytes moved by one fused forward+backward call. Without byte counts in the trace, they follow
// from what each job moves (src/engine/stage_executor.cpp), given every stage's weight bytes W_s:
//   every job uploads W_s; tail and backward jobs download W_s of gradients (model dtype);
//   forward job of stage s: uploads its input (token ids for s = 0, else hidden states H),
//     downloads H;
//   tail job: uploads its input and the labels, downloads the input gradient H (s > 0);
//   backward job of stage s: uploads the incoming gradient H and the saved stage input (ids for
//     s = 0, else H), downloads the input gradient H (s > 0);
// with H = tokens * hidden * dtype bytes and ids = labels = tokens * 8 bytes (int64), summed over
// the microbatches. The rotary inverse frequencies (head_dim / 2 floats per layer and
// microbatch) are left out.
PcieResult pcie_bytes(const Trace &trace, const Shape &s, const Options &o, int64_t tokens,
                      const std::vector<double> &layer_bytes, bool on_gpu) {
    PcieResult r;
    const size_t S = [&] {
        size_t m = 0;
        for (const auto &kv : trace.jobs)
            m = std::max(m, kv.second.stage + 1);
        return m;
    }();
    std::vector<double> stage_w;
    std::map<size_t, double> dev_h2d, dev_d2h;
    if (trace.has_bytes) {
        r.method = "trace-bytes";
        r.h2d_weights = r.h2d_activations = r.d2h_grads = r.d2h_activations = 0;
    } else {
        std::vector<int> plan;
        if (o.plan != "auto") {
            std::stringstream ss(o.plan);
            std::string item;
            while (std::getline(ss, item, ','))
                plan.push_back(std::stoi(item));
            r.method = "explicit-plan";
        } else if (trace.has_transfers) {
            std::vector<double> sum(S, 0.0), n(S, 0.0);
            for (const auto &kv : trace.jobs) {
                auto it = kv.second.spans.find("weights");
                if (it == kv.second.spans.end())
                    continue;
                for (const Span &sp : it->second) {
                    sum[kv.second.stage] += sp.end - sp.start;
                    n[kv.second.stage] += 1;
                }
            }
            std::vector<double> stage_ms(S);
            for (size_t k = 0; k < S; ++k)
                stage_ms[k] = n[k] > 0 ? sum[k] / n[k] : 0.0;
            plan = infer_plan(layer_bytes, stage_ms);
            r.method = "inferred-plan";
        }
        if (plan.size() != S) {
            r.method = on_gpu ? "unavailable: no stage plan" : "unavailable: cpu devices with "
                                                               "an automatic plan (give --plan)";
            return r;
        }
        size_t next = 0;
        for (int count : plan) {
            double w = 0;
            for (int k = 0; k < count && next < layer_bytes.size(); ++k)
                w += layer_bytes[next++];
            stage_w.push_back(w);
        }
        r.plan = plan;
        const double H = static_cast<double>(tokens) * s.hidden * dtype_bytes(o.dtype);
        const double ids = static_cast<double>(tokens) * 8.0, labels = ids;
        r.h2d_weights = r.h2d_activations = r.d2h_grads = r.d2h_activations = 0;
        for (const auto &kv : trace.jobs) {
            const TraceJob &j = kv.second;
            const double W = stage_w[j.stage];
            const double input = j.stage == 0 ? ids : H;
            double up_act = 0, down_act = 0, grads = 0;
            if (j.kind == "forward") {
                up_act = input;
                down_act = H;
            } else if (j.kind == "tail") {
                up_act = input + labels;
                down_act = j.stage > 0 ? H : 0;
                grads = W;
            } else {
                up_act = H + input;
                down_act = j.stage > 0 ? H : 0;
                grads = W;
            }
            r.h2d_weights += W;
            r.h2d_activations += up_act;
            r.d2h_grads += grads;
            r.d2h_activations += down_act;
            dev_h2d[j.device] += W + up_act;
            dev_d2h[j.device] += grads + down_act;
        }
    }
    // Busy time of each direction per device (union of its streams' spans); bytes from the trace
    // when it carries them.
    std::map<size_t, std::vector<Span>> up, down;
    for (const auto &kv : trace.jobs) {
        const TraceJob &j = kv.second;
        for (const auto &st : j.spans) {
            if (st.first == "weights" || st.first == "activation_upload")
                up[j.device].insert(up[j.device].end(), st.second.begin(), st.second.end());
            else if (st.first == "download")
                down[j.device].insert(down[j.device].end(), st.second.begin(), st.second.end());
        }
        if (trace.has_bytes) {
            auto b = [&](const char *k) {
                auto it = j.bytes.find(k);
                return it == j.bytes.end() ? 0.0 : it->second;
            };
            r.h2d_weights += b("weights");
            r.h2d_activations += b("activation_upload");
            // Downloads carry gradients, activations and outputs alike; the trace does not say
            // which, so they are all reported as activations.
            r.d2h_activations += b("download");
            dev_h2d[j.device] += b("weights") + b("activation_upload");
            dev_d2h[j.device] += b("download");
        }
    }
    std::set<size_t> devices;
    for (const auto &kv : trace.jobs)
        devices.insert(kv.second.device);
    for (size_t d : devices) {
        double up_ms = length_of(union_of(up[d])), down_ms = length_of(union_of(down[d]));
        r.h2d_busy_ms += up_ms;
        r.d2h_busy_ms += down_ms;
        json dj;
        dj["device"] = d;
        dj["h2d_bytes"] = dev_h2d[d];
        dj["d2h_bytes"] = dev_d2h[d];
        dj["h2d_busy_ms"] = round_to(up_ms, 3);
        dj["d2h_busy_ms"] = round_to(down_ms, 3);
        dj["h2d_gbps_busy"] = up_ms > 0 ? json(round_to(dev_h2d[d] / up_ms / 1e6, 3)) : json(nullptr);
        dj["d2h_gbps_busy"] =
            down_ms > 0 ? json(round_to(dev_d2h[d] / down_ms / 1e6, 3)) : json(nullptr);
        r.per_device.push_back(dj);
    }
    return r;
}

// Per device, as bench/trace_summary.py: the compute window (first to last compute), how much
// of it had no compute running, and how much of the weight-upload time overlapped compute.
json trace_devices(const Trace &trace) {
    std::map<size_t, std::map<std::string, std::vector<Span>>> by_dev;
    for (const auto &kv : trace.jobs)
        for (const auto &st : kv.second.spans) {
            auto &v = by_dev[kv.second.device][st.first];
            v.insert(v.end(), st.second.begin(), st.second.end());
        }
    json out = json::array();
    for (auto &dv : by_dev) {
        std::vector<Span> compute = union_of(dv.second["compute"]);
        json d;
        d["device"] = dv.first;
        if (compute.empty()) {
            out.push_back(d);
            continue;
        }
        double window = compute.back().end - compute.front().start;
        double busy = length_of(compute);
        d["window_ms"] = round_to(window, 3);
        d["compute_ms"] = round_to(busy, 3);
        d["compute_idle_fraction"] = window > 0 ? round_to(1.0 - busy / window, 4) : 0.0;
        auto it = dv.second.find("weights");
        if (it != dv.second.end() && !it->second.empty()) {
            double wms = 0, hidden = 0;
            for (const Span &sp : it->second) {
                wms += sp.end - sp.start;
                hidden += overlap_with(sp, compute);
            }
            d["weights_ms"] = round_to(wms, 3);
            d["weight_upload_hidden"] = wms > 0 ? round_to(hidden / wms, 4) : 0.0;
        }
        for (const char *k : {"activation_upload", "download"}) {
            auto s = dv.second.find(k);
            if (s != dv.second.end())
                d[std::string(k) + "_ms"] = round_to(length_of(union_of(s->second)), 3);
        }
        out.push_back(d);
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// GPU helpers that need no CUDA headers (the allocator and hooks interfaces of c10/ATen).
// ---------------------------------------------------------------------------------------------
void device_synchronize(const at::Device &dev) {
    if (dev.is_cuda())
        at::detail::getCUDAHooks().deviceSynchronize(dev.index());
}
void empty_cuda_cache() {
    if (at::hasCUDA())
        c10::getDeviceAllocator(c10::kCUDA)->emptyCache();
}
int64_t cuda_total_bytes(int device) {
    try {
        return static_cast<int64_t>(
            c10::getDeviceAllocator(c10::kCUDA)->getMemoryInfo(static_cast<c10::DeviceIndex>(device))
                .second);
    } catch (const std::exception &) {
        return -1;
    }
}
int64_t gpu_peak(int num_gpus) {
    int64_t peak = -1;
    for (int d = 0; d < num_gpus; ++d) {
        int64_t now = 0, p = 0;
        if (rp_cuda_memory_stats(&now, &p, d) == RP_OK)
            peak = std::max(peak, p);
    }
    return peak;
}
void gpu_reset_peak(int num_gpus) {
    for (int d = 0; d < num_gpus; ++d)
        rp_cuda_reset_peak_memory(d);
}

// ---------------------------------------------------------------------------------------------
// The baseline: a plain libtorch Qwen3 (Hugging Face's arithmetic) trained on one device.
// CUDA: fp32 weights, bf16/f16 autocast for the forward, fused AdamW on the GPU, no activation
// checkpointing (what "plain PyTorch" measured in DESIGN.md section 7). CPU: fp32, no autocast,
// PyTorch's fused CPU AdamW.
// ---------------------------------------------------------------------------------------------
struct BaselineLayer {
    at::Tensor q, k, v, o, q_norm, k_norm, gate, up, down, in_norm, post_norm;
};

struct Baseline {
    Shape s;
    at::Device dev;
    at::Tensor embed, final_norm, lm_head;
    std::vector<BaselineLayer> layers;
    std::vector<at::Tensor> params, exp_avg, exp_avg_sq, steps;
    at::Tensor cos, sin; // [1, 1, seq, head_dim], fp32

    Baseline(const Shape &shape, at::Device device, uint64_t seed) : s(shape), dev(device) {
        at::manual_seed(seed);
        auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
        auto normal = [&](std::vector<int64_t> sz) {
            at::Tensor t = at::empty(sz, f32).normal_(0.0, 0.02);
            params.push_back(t);
            return t;
        };
        auto ones = [&](std::vector<int64_t> sz) {
            at::Tensor t = at::ones(sz, f32);
            params.push_back(t);
            return t;
        };
        const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
        embed = normal({s.vocab, s.hidden});
        for (int64_t l = 0; l < s.layers; ++l) {
            BaselineLayer b;
            b.q = normal({q, s.hidden});
            b.k = normal({kv, s.hidden});
            b.v = normal({kv, s.hidden});
            b.o = normal({s.hidden, q});
            b.q_norm = ones({s.head_dim});
            b.k_norm = ones({s.head_dim});
            b.gate = normal({s.intermediate, s.hidden});
            b.up = normal({s.intermediate, s.hidden});
            b.down = normal({s.hidden, s.intermediate});
            b.in_norm = ones({s.hidden});
            b.post_norm = ones({s.hidden});
            layers.push_back(b);
        }
        final_norm = ones({s.hidden});
        lm_head = s.tied ? embed : normal({s.vocab, s.hidden});
        for (at::Tensor &p : params) {
            p.requires_grad_(true);
            exp_avg.push_back(at::zeros_like(p));
            exp_avg_sq.push_back(at::zeros_like(p));
            // Fused AdamW reads the step count from a float tensor on the parameters' device.
            steps.push_back(at::zeros({}, f32));
        }
    }

    int64_t num_params() const {
        int64_t n = 0;
        for (const at::Tensor &p : params)
            n += p.numel();
        return n;
    }

    static at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &w, double eps) {
        at::Tensor xf = x.to(at::kFloat);
        at::Tensor n = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
        return w * n.to(x.scalar_type());
    }
    static at::Tensor rotate_half(const at::Tensor &x) {
        const int64_t h = x.size(-1) / 2;
        return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
    }

    void make_rotary(int64_t seq) {
        if (cos.defined() && cos.size(2) == seq)
            return;
        auto f32 = at::TensorOptions().dtype(at::kFloat);
        at::Tensor inv = at::pow(1000000.0, at::arange(0, s.head_dim, 2, f32) / double(s.head_dim))
                             .reciprocal();
        at::Tensor freqs = at::arange(seq, f32).unsqueeze(1) * inv.unsqueeze(0);
        at::Tensor emb = at::cat({freqs, freqs}, -1).view({1, 1, seq, s.head_dim}).to(dev);
        cos = emb.cos();
        sin = emb.sin();
    }

    at::Tensor loss(const at::Tensor &ids) {
        const int64_t b = ids.size(0), t = ids.size(1);
        make_rotary(t);
        const double eps = 1e-6;
        at::Tensor x = at::embedding(embed, ids);
        for (const BaselineLayer &L : layers) {
            at::Tensor h = rms_norm(x, L.in_norm, eps);
            at::Tensor q = at::linear(h, L.q).view({b, t, s.heads, s.head_dim});
            at::Tensor k = at::linear(h, L.k).view({b, t, s.kv_heads, s.head_dim});
            at::Tensor v = at::linear(h, L.v).view({b, t, s.kv_heads, s.head_dim});
            q = rms_norm(q, L.q_norm, eps).transpose(1, 2);
            k = rms_norm(k, L.k_norm, eps).transpose(1, 2);
            v = v.transpose(1, 2);
            at::Tensor c = cos.to(q.scalar_type()), sn = sin.to(q.scalar_type());
            q = q * c + rotate_half(q) * sn;
            k = k * c + rotate_half(k) * sn;
            at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true,
                                                            std::nullopt, /*enable_gqa=*/true);
            a = a.transpose(1, 2).reshape({b, t, s.heads * s.head_dim});
            x = x + at::linear(a, L.o);
            h = rms_norm(x, L.post_norm, eps);
            x = x + at::linear(at::silu(at::linear(h, L.gate)) * at::linear(h, L.up), L.down);
        }
        x = rms_norm(x, final_norm, eps);
        // Hugging Face: full logits, upcast to fp32, token i scored against token i + 1.
        at::Tensor logits = at::linear(x, lm_head).to(at::kFloat);
        at::Tensor targets =
            at::cat({ids.narrow(1, 1, t - 1), at::full({b, 1}, -100, ids.options())}, 1);
        return at::cross_entropy_loss(logits.view({b * t, s.vocab}), targets.view({b * t}), {},
                                      at::Reduction::Mean, -100);
    }

    // One optimizer step over the batch, split along dim 0 into `microbatches` pieces whose
    // gradients accumulate (each piece's mean loss weighted 1 / microbatches). Returns the mean
    // loss of the batch.
    double train_step(const at::Tensor &ids, int64_t microbatches, at::ScalarType autocast_dtype,
                      double lr, double wd) {
        const bool autocast = dev.is_cuda() && autocast_dtype != at::kFloat;
        const int64_t b = ids.size(0), per = (b + microbatches - 1) / microbatches;
        at::Tensor total = at::zeros({}, ids.options().dtype(at::kFloat));
        for (int64_t start = 0; start < b; start += per) {
            const int64_t len = std::min(per, b - start);
            at::Tensor l;
            if (autocast) {
                at::autocast::set_autocast_dtype(at::kCUDA, autocast_dtype);
                at::autocast::set_autocast_enabled(at::kCUDA, true);
            }
            try {
                l = loss(ids.narrow(0, start, len)) * (static_cast<double>(len) / b);
            } catch (...) {
                if (autocast) {
                    at::autocast::set_autocast_enabled(at::kCUDA, false);
                    at::autocast::clear_cache();
                }
                throw;
            }
            if (autocast) {
                // As leaving torch.autocast: backward runs outside it, the weight casts go.
                at::autocast::set_autocast_enabled(at::kCUDA, false);
                at::autocast::clear_cache();
            }
            l.backward();
            total.add_(l.detach());
        }
        std::vector<at::Tensor> grads;
        for (at::Tensor &p : params)
            grads.push_back(p.grad());
        {
            at::NoGradGuard no_grad;
            at::_foreach_add_(steps, 1.0);
            at::_fused_adamw_(params, grads, exp_avg, exp_avg_sq, {}, steps, lr, 0.9, 0.999, wd,
                              1e-8, /*amsgrad=*/false, /*maximize=*/false);
        }
        for (at::Tensor &p : params)
            p.mutable_grad().reset(); // zero_grad(set_to_none=True)
        return total.item<double>();  // waits for the step's GPU work
    }
};

// Rough bytes the baseline needs on one GPU: fp32 weights, gradients and two moments
// (16 bytes/parameter); for one microbatch, the logits (bf16, their fp32 copy, the saved
// log-softmax and two fp32 gradients: 18 bytes per logit) and, per layer and token, about
// 40 x hidden + 8 x intermediate bytes of saved activations (fp32 residual stream and norm
// inputs, bf16 casts, attention and MLP intermediates). Only used to skip runs that cannot fit;
// a run that might fit is tried.
double baseline_bytes_estimate(const Shape &s, int64_t microbatch_tokens) {
    const double p = static_cast<double>(total_params(s));
    const double t = static_cast<double>(microbatch_tokens);
    const double logits = t * s.vocab * 18.0;
    const double acts = t * s.layers * (40.0 * s.hidden + 8.0 * s.intermediate);
    return 16.0 * p + logits + acts;
}

json run_baseline(const Shape &s, const Options &o, int64_t batch, int64_t seq,
                  int64_t microbatches, int num_gpus) {
    json r;
    const at::Device dev = o.devices == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    const int64_t tokens = batch * seq;
    const int64_t micro = std::max<int64_t>(1, std::min(o.baseline_microbatches > 0
                                                            ? o.baseline_microbatches
                                                            : microbatches,
                                                        batch));
    r["baseline_microbatches"] = micro;
    if (dev.is_cuda()) {
        int64_t total = cuda_total_bytes(0);
        double need = baseline_bytes_estimate(s, (batch + micro - 1) / micro * seq);
        r["baseline_bytes_estimate"] = need;
        if (total > 0 && need > 1.05 * static_cast<double>(total)) {
            r["baseline_status"] = "skipped: needs about " + std::to_string(need / 1073741824.0) +
                                   " GiB on the GPU, which has " +
                                   std::to_string(total / 1073741824.0) + " GiB";
            return r;
        }
    }
    const at::ScalarType ac = o.dtype == "bf16" ? at::kBFloat16 : o.dtype == "f16" ? at::kHalf
                                                                                   : at::kFloat;
    const int steps = o.baseline_steps > 0 ? o.baseline_steps : o.steps;
    TokenStream stream{o.seed * 7919 + 17, s.vocab};
    std::vector<int64_t> host_ids(static_cast<size_t>(tokens));
    std::vector<double> losses;
    try {
        if (dev.is_cuda()) {
            empty_cuda_cache();
            gpu_reset_peak(num_gpus);
        }
        progress("baseline: building the plain libtorch model on " + dev.str());
        Baseline b(s, dev, o.seed);
        r["baseline_params"] = b.num_params();
        auto next_ids = [&] {
            stream.fill(host_ids);
            return at::from_blob(host_ids.data(), {batch, seq}, at::kLong).to(dev);
        };
        for (int i = 0; i < o.baseline_warmup; ++i) {
            auto t0 = Clock::now();
            double l = b.train_step(next_ids(), micro, ac, o.lr, o.weight_decay);
            losses.push_back(l);
            progress("baseline warm-up " + std::to_string(i + 1) + "/" +
                     std::to_string(o.baseline_warmup) + ": " + std::to_string(ms_since(t0)) +
                     " ms, loss " + std::to_string(l));
        }
        device_synchronize(dev);
        std::vector<double> iter;
        auto t0 = Clock::now();
        for (int i = 0; i < steps; ++i) {
            auto ti = Clock::now();
            double l = b.train_step(next_ids(), micro, ac, o.lr, o.weight_decay);
            losses.push_back(l);
            iter.push_back(ms_since(ti));
            progress("baseline step " + std::to_string(i + 1) + "/" + std::to_string(steps) +
                     ": " + std::to_string(iter.back()) + " ms, loss " + std::to_string(l));
        }
        device_synchronize(dev);
        const double total_ms = ms_since(t0);
        r["baseline_status"] = "ok";
        r["baseline_mode"] = dev.is_cuda() && ac != at::kFloat
                                 ? std::string("fp32 weights, ") + o.dtype +
                                       " autocast, fused AdamW, no checkpointing, gradient "
                                       "accumulation over the microbatches"
                                 : "fp32, fused AdamW, no checkpointing, gradient accumulation "
                                   "over the microbatches";
        r["baseline_steps"] = steps;
        r["baseline_iter_ms"] = round_to(total_ms / steps, 3);
        r["baseline_tokens_per_s"] = round_to(tokens * steps / (total_ms / 1000.0), 1);
        r["baseline_peak_gpu_bytes"] = dev.is_cuda() ? json(gpu_peak(num_gpus)) : json(nullptr);
        r["baseline_loss_first"] = losses.front();
        r["baseline_loss_last"] = losses.back();
    } catch (const c10::OutOfMemoryError &e) {
        r["baseline_status"] = std::string("out of memory: ") + e.what_without_backtrace();
        r["baseline_peak_gpu_bytes"] = dev.is_cuda() ? json(gpu_peak(num_gpus)) : json(nullptr);
    } catch (const c10::Error &e) {
        r["baseline_status"] = std::string("error: ") + e.what_without_backtrace();
    } catch (const std::exception &e) {
        r["baseline_status"] = std::string("error: ") + e.what();
    }
    if (dev.is_cuda()) {
        device_synchronize(dev);
        empty_cuda_cache(); // give the GPU back before RoundPipe measures its free memory
    }
    return r;
}

// ---------------------------------------------------------------------------------------------
// RoundPipe
// ---------------------------------------------------------------------------------------------
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

// Host bytes per parameter of the current engine (src/engine/param_store.h): fp32 master,
// model-dtype live and staged copies, fp32 grad and step_grad, two fp32 AdamW moments.
// --host-bytes-per-param overrides it for engine modes this program does not know about.
double engine_host_bytes_per_param(const Options &o) {
    if (o.host_bytes_per_param > 0)
        return o.host_bytes_per_param;
    // The layouts of rp_host_memory_mode: master, weight copies, gradient buffers, AdamW state.
    if (o.host_memory == "saving")
        return 12.0;
    return 4.0 + 2.0 * dtype_bytes(o.dtype) + 8.0 + 8.0;
}

void run_roundpipe(json &out, const Shape &s, const Options &o, int64_t batch, int64_t seq,
                   int64_t microbatches, int num_gpus) {
    const int64_t tokens = batch * seq;
    const bool on_gpu = o.devices == "cuda";

    ModelHandle model;
    {
        rp_model_options *mo = nullptr;
        rp_run_config *rc = nullptr;
        RP_CHECK(rp_model_options_create(&mo));
        std::unique_ptr<rp_model_options, void (*)(rp_model_options *)> mo_guard(
            mo, rp_model_options_destroy);
        RP_CHECK(rp_model_options_set_model_dtype(mo, rp_dtype_of(o.dtype)));
        RP_CHECK(rp_model_options_set_optim_dtype(mo, rp_dtype_of(o.optim_dtype)));
        RP_CHECK(rp_model_options_set_devices(mo, on_gpu ? RP_DEVICE_CUDA : RP_DEVICE_CPU,
                                              o.num_devices));
        RP_CHECK(rp_model_options_set_seed(mo, o.seed));
        RP_CHECK(rp_model_options_set_name(mo, ("bench-" + s.name).c_str()));
        RP_CHECK(rp_model_options_set_host_memory_mode(
            mo, o.host_memory == "saving" ? RP_HOST_MEMORY_SAVING : RP_HOST_MEMORY_STANDARD));
        RP_CHECK(rp_model_options_set_pin_mode(mo, o.pin == "alloc"      ? RP_PIN_ALLOC
                                                   : o.pin == "register" ? RP_PIN_REGISTER
                                                                         : RP_PIN_OFF));
        if (o.gpu_cap_gib > 0)
            RP_CHECK(rp_model_options_set_gpu_memory_cap(
                mo, static_cast<int64_t>(o.gpu_cap_gib * 1073741824.0)));
        if (o.plan != "auto") {
            std::vector<int32_t> plan;
            std::stringstream ss(o.plan);
            std::string item;
            while (std::getline(ss, item, ','))
                plan.push_back(std::stoi(item));
            RP_CHECK(rp_model_options_set_stage_plan(mo, plan.data(), plan.size()));
        }
        RP_CHECK(rp_run_config_create(&rc));
        std::unique_ptr<rp_run_config, void (*)(rp_run_config *)> rc_guard(rc,
                                                                           rp_run_config_destroy);
        RP_CHECK(rp_run_config_set_num_microbatch(rc, static_cast<int32_t>(microbatches)));
        RP_CHECK(rp_run_config_set_recompute_grain(
            rc, o.grain == "layer" ? RP_GRAIN_LAYER : RP_GRAIN_STAGE));
        RP_CHECK(rp_model_options_set_run_config(mo, rc));
        progress("roundpipe: creating the model (random weights on the host)");
        auto t0 = Clock::now();
        RP_CHECK(rp_model_create_from_hf_config(&model.m, hf_config_json(s).c_str(), mo));
        out["create_ms"] = round_to(ms_since(t0), 1);
    }
    int32_t stages = 0, devices = 0;
    RP_CHECK(rp_model_num_devices(&devices, model.m));
    int64_t cap = 0;
    RP_CHECK(rp_model_gpu_memory_cap(&cap, model.m));
    out["num_devices"] = devices;
    out["gpu_memory_cap_bytes"] = cap;

    LossHandle loss;
    RP_CHECK(rp_loss_create(&loss.l, RP_LOSS_CAUSAL_LM));
    OptHandle opt;
    RP_CHECK(rp_optimizer_create(&opt.o, RP_OPTIMIZER_ADAMW));
    RP_CHECK(rp_optimizer_set_learning_rate(opt.o, o.lr));
    RP_CHECK(rp_optimizer_set_weight_decay(opt.o, o.weight_decay));

    TokenStream stream{o.seed * 7919 + 17, s.vocab};
    std::vector<int64_t> ids(static_cast<size_t>(tokens));
    DlI64 ids_dl(ids.data(), batch, seq), labels_dl(ids.data(), batch, seq);
    const DLManagedTensor *inputs[1] = {&ids_dl.managed};
    auto fb = [&] {
        stream.fill(ids); // labels are the ids: token i is scored against token i + 1
        double l = 0;
        RP_CHECK(rp_forward_backward(&l, nullptr, model.m, inputs, 1, &labels_dl.managed, loss.l,
                                     nullptr));
        return l;
    };

    std::vector<double> losses;
    if (on_gpu)
        gpu_reset_peak(num_gpus);
    for (int i = 0; i < o.warmup; ++i) {
        auto t0 = Clock::now();
        losses.push_back(fb());
        RP_CHECK(rp_step(model.m, opt.o, 1));
        progress("roundpipe warm-up " + std::to_string(i + 1) + "/" + std::to_string(o.warmup) +
                 ": " + std::to_string(ms_since(t0)) + " ms, loss " +
                 std::to_string(losses.back()));
    }
    const int64_t peak_warmup = on_gpu ? gpu_peak(num_gpus) : -1;
    if (on_gpu)
        gpu_reset_peak(num_gpus);

    // Steady state: each iteration is forward_backward (the previous step running meanwhile on
    // the optimizer thread) plus rp_step, which first waits for that previous step: the time
    // spent inside rp_step is the optimizer time the GPU work did not hide.
    std::vector<double> fb_ms, step_ms;
    auto t_loop = Clock::now();
    for (int i = 0; i < o.steps; ++i) {
        auto t0 = Clock::now();
        losses.push_back(fb());
        fb_ms.push_back(ms_since(t0));
        auto t1 = Clock::now();
        RP_CHECK(rp_step(model.m, opt.o, 1));
        step_ms.push_back(ms_since(t1));
        progress("roundpipe step " + std::to_string(i + 1) + "/" + std::to_string(o.steps) +
                 ": forward_backward " + std::to_string(fb_ms.back()) + " ms, rp_step " +
                 std::to_string(step_ms.back()) + " ms, loss " + std::to_string(losses.back()));
    }
    const double loop_ms = ms_since(t_loop);
    const int64_t peak_steady = on_gpu ? gpu_peak(num_gpus) : -1;
    const char *trace_text = nullptr;
    RP_CHECK(rp_model_trace_json(&trace_text, model.m));
    const std::string trace_json_text = trace_text ? trace_text : "";
    RP_CHECK(rp_model_num_stages(&stages, model.m));

    // The same calls without an optimizer step in flight. Each starts from zeroed gradients, as
    // in the timed loop (one call per step): calls that add to earlier gradients take another
    // path in the engine (their contributions are held back until the call succeeds).
    RP_CHECK(rp_synchronize(model.m));
    std::vector<double> fb_only;
    for (int i = 0; i < o.fb_only_steps; ++i) {
        RP_CHECK(rp_zero_grad(model.m));
        auto t0 = Clock::now();
        fb();
        fb_only.push_back(ms_since(t0));
        progress("roundpipe forward_backward alone " + std::to_string(i + 1) + "/" +
                 std::to_string(o.fb_only_steps) + ": " + std::to_string(fb_only.back()) + " ms");
    }
    // The optimizer step alone: a synchronous rp_step returns once the update, the model-dtype
    // copy of the new weights and the gradient reset are done.
    std::vector<double> opt_ms;
    for (int i = 0; i < o.opt_steps; ++i) {
        auto t0 = Clock::now();
        RP_CHECK(rp_step(model.m, opt.o, 0));
        opt_ms.push_back(ms_since(t0));
        progress("roundpipe optimizer step alone " + std::to_string(i + 1) + "/" +
                 std::to_string(o.opt_steps) + ": " + std::to_string(opt_ms.back()) + " ms");
    }
    RP_CHECK(rp_synchronize(model.m));
    const int64_t peak_rss = peak_rss_bytes();

    if (!o.trace_file.empty()) {
        std::ofstream f(o.trace_file);
        f << trace_json_text;
        if (!f)
            throw BenchError("cannot write the trace to " + o.trace_file);
    }

    // Throughput and FLOPs.
    const double iter_ms = loop_ms / o.steps;
    const double secs = loop_ms / 1000.0;
    const double n_tok = static_cast<double>(tokens) * o.steps;
    const double fp = static_cast<double>(flop_params(s));
    const double attn = attention_forward_flops(s, batch, seq);
    out["stages"] = stages;
    out["tokens_per_s"] = round_to(n_tok / secs, 1);
    out["iter_ms"] = round_to(iter_ms, 3);
    out["fb_ms"] = round_to(mean(fb_ms), 3);
    out["model_tflops"] = round_to(6.0 * fp * n_tok / secs / 1e12, 3);
    out["hw_tflops"] = round_to((8.0 * fp * tokens + 4.0 * attn) * o.steps / secs / 1e12, 3);
    out["attention_flops_per_iter"] = 4.0 * attn;

    // Memory.
    out["peak_gpu_bytes"] = on_gpu ? json(std::max(peak_warmup, peak_steady)) : json(nullptr);
    out["peak_gpu_steady_bytes"] = on_gpu ? json(peak_steady) : json(nullptr);
    out["peak_host_rss_bytes"] = peak_rss;
    out["host_bytes_per_param"] = round_to(double(peak_rss) / double(total_params(s)), 3);
    int64_t state_bytes = 0, state_elements = 0;
    RP_CHECK(rp_model_host_state_bytes(&state_bytes, &state_elements, model.m));
    out["host_state_bytes"] = state_bytes;
    out["host_state_bytes_per_param"] = round_to(double(state_bytes) / double(state_elements), 3);

    // PCIe.
    Trace trace = parse_trace(trace_json_text);
    std::vector<double> lb = layer_weight_bytes(model.m, s, dtype_bytes(o.dtype));
    PcieResult p = pcie_bytes(trace, s, o, tokens, lb, on_gpu);
    const double fb_last_ms = fb_ms.back();
    out["pcie_method"] = p.method;
    out["pcie_plan"] = p.plan.empty() ? json(nullptr) : json(p.plan);
    const bool have = std::isfinite(p.h2d_weights);
    const double h2d = p.h2d_weights + p.h2d_activations, d2h = p.d2h_grads + p.d2h_activations;
    out["pcie_h2d_bytes_per_iter"] = have ? json(h2d) : json(nullptr);
    out["pcie_d2h_bytes_per_iter"] = have ? json(d2h) : json(nullptr);
    out["pcie_h2d_weight_bytes"] = num_or_null(p.h2d_weights);
    out["pcie_h2d_activation_bytes"] = num_or_null(p.h2d_activations);
    out["pcie_d2h_grad_bytes"] = num_or_null(p.d2h_grads);
    out["pcie_d2h_activation_bytes"] = num_or_null(p.d2h_activations);
    auto gbps = [&](double bytes, double ms) {
        return on_gpu && have && ms > 0 ? json(round_to(bytes / ms / 1e6, 3)) : json(nullptr);
    };
    out["pcie_h2d_gbps_busy"] = gbps(h2d, p.h2d_busy_ms);
    out["pcie_d2h_gbps_busy"] = gbps(d2h, p.d2h_busy_ms);
    out["pcie_h2d_gbps_avg"] = gbps(h2d, fb_last_ms);
    out["pcie_d2h_gbps_avg"] = gbps(d2h, fb_last_ms);
    out["pcie_devices"] = on_gpu ? p.per_device : json(nullptr);
    if (o.check && p.method == "explicit-plan") {
        // Self-test of the plan inference used on GPUs: upload times proportional to the
        // explicit plan's stage bytes, off by a few percent, must give that plan back.
        std::vector<double> stage_ms;
        size_t next = 0;
        for (size_t k = 0; k < p.plan.size(); ++k) {
            double w = 0;
            for (int c = 0; c < p.plan[k]; ++c)
                w += lb[next++];
            stage_ms.push_back(w * (k % 2 ? 0.97 : 1.03));
        }
        out["plan_inference_selftest"] = infer_plan(lb, stage_ms) == p.plan;
    }
    out["trace_devices"] = trace_devices(trace);
    // Host time of the last forward_backward outside its device timeline: input checks and
    // splitting before the first span, gradient accumulation into the fp32 host gradients and
    // the loss read-back after the last one (the GPUs idle then, unless another call overlaps).
    double trace_end = 0;
    for (const auto &kv : trace.jobs)
        for (const auto &st : kv.second.spans)
            for (const Span &sp : st.second)
                trace_end = std::max(trace_end, sp.end);
    out["trace_window_ms"] = round_to(trace_end, 3);
    out["fb_outside_trace_ms"] = round_to(fb_last_ms - trace_end, 3);

    // Optimizer.
    const double opt_step = median(opt_ms), fb_alone = median(fb_only);
    const double exposed = mean(step_ms);
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
    out["loss_first"] = losses.front();
    out["loss_last"] = losses.back();
    for (double l : losses)
        if (!std::isfinite(l))
            throw BenchError("RoundPipe loss is not finite: " + std::to_string(l));
}

} // namespace

int main(int argc, char **argv) {
    Options o = parse(argc, argv);
    const Shape *sp = nullptr;
    for (const Shape &s : kShapes)
        if (s.name == o.shape)
            sp = &s;
    if (!sp)
        usage(argv[0], "unknown shape '" + o.shape + "'");
    const Shape &s = *sp;
    const int64_t batch = o.batch > 0 ? o.batch : s.batch;
    const int64_t seq = o.seq > 0 ? o.seq : s.seq;
    const int64_t micro = o.microbatches > 0 ? o.microbatches : s.microbatches;

    json out;
    out["bench"] = "train";
    out["status"] = "ok";
    out["label"] = o.label;
    out["roundpipe_version"] = rp_version();
    out["shape"] = s.name;
    out["params"] = total_params(s);
    out["flop_params"] = flop_params(s);
    out["batch"] = batch;
    out["seq"] = seq;
    out["tokens_per_iter"] = batch * seq;
    out["microbatches"] = micro;
    out["grain"] = o.grain;
    out["dtype"] = o.dtype;
    out["optim_dtype"] = o.optim_dtype;
    out["devices"] = o.devices;
    out["plan"] = o.plan;
    out["gpu_cap_gib"] = o.gpu_cap_gib;
    out["pin"] = o.pin;
    out["host_memory"] = o.host_memory;
    out["steps"] = o.steps;
    out["warmup"] = o.warmup;
    out["host_threads"] = at::get_num_threads();

    int exit_code = 0;
    try {
        int32_t gpus = 0;
        RP_CHECK(rp_cuda_device_count(&gpus));
        out["visible_gpus"] = gpus;
        if (o.devices == "cuda" && gpus == 0)
            throw BenchError("--devices cuda but no GPU is visible");

        // Host memory: skip (rather than be killed) when the engine's host state cannot fit.
        const double need = engine_host_bytes_per_param(o) * double(total_params(s));
        const int64_t avail = proc_kib_field("/proc/meminfo", "MemAvailable:");
        out["host_bytes_estimate"] = need;
        out["host_mem_available_bytes"] = avail;
        if (o.host_check && avail > 0 && need > 0.95 * double(avail)) {
            out["status"] = "skipped";
            out["reason"] = "the engine's host state needs about " +
                            std::to_string(need / 1073741824.0) + " GiB (" +
                            std::to_string(engine_host_bytes_per_param(o)) +
                            " bytes/parameter), only " + std::to_string(avail / 1073741824.0) +
                            " GiB available; --host-check off to try anyway";
            std::printf("%s\n", out.dump().c_str());
            return 0;
        }

        // The baseline runs first: an explicit GPU memory cap given to RoundPipe limits the
        // whole process's allocator, and the baseline's cached blocks are given back before
        // RoundPipe sizes its cap from the free memory.
        if (o.baseline) {
            json b = run_baseline(s, o, batch, seq, micro, gpus);
            for (auto it = b.begin(); it != b.end(); ++it)
                out[it.key()] = it.value();
        } else {
            out["baseline_status"] = "off";
        }
        out["host_rss_reset"] = reset_peak_rss();
        run_roundpipe(out, s, o, batch, seq, micro, gpus);
        if (out.contains("baseline_tokens_per_s") && out["baseline_tokens_per_s"].is_number())
            out["ratio_vs_baseline"] = round_to(out["tokens_per_s"].get<double>() /
                                                    out["baseline_tokens_per_s"].get<double>(),
                                                4);
        else
            out["ratio_vs_baseline"] = nullptr;

        if (o.check) {
            // Smoke checks: random weights at std 0.02 give a first loss near ln(vocab) in both
            // systems, and every figure that must exist does.
            const double ln_v = std::log(static_cast<double>(s.vocab));
            auto near = [&](const char *key) {
                return out.contains(key) && out[key].is_number() &&
                       std::fabs(out[key].get<double>() - ln_v) < 1.0;
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
            if (o.plan != "auto" && !out["pcie_h2d_bytes_per_iter"].is_number())
                failed += " pcie_h2d_bytes_per_iter";
            if (out.contains("plan_inference_selftest") && !out["plan_inference_selftest"].get<bool>())
                failed += " plan_inference_selftest";
            if (!out["opt_hidden_fraction"].is_number())
                failed += " opt_hidden_fraction";
            if (!failed.empty()) {
                out["status"] = "check failed:" + failed;
                exit_code = 1;
            }
        }
    } catch (const std::exception &e) {
        out["status"] = "error";
        out["error"] = e.what();
        exit_code = 1;
    }
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
    return exit_code;
}
