#include "trace_analysis.h"

#include <algorithm>
#include <set>

namespace tb {
namespace {

bool is_upload(const std::string &tid) { return tid == "weights" || tid == "activation_upload"; }

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

void append_spans(std::vector<Span> &to, const std::vector<StreamEvent> &events) {
    for (const StreamEvent &e : events)
        to.push_back(e.span);
}

double bytes_of(const std::vector<StreamEvent> &events) {
    double b = 0;
    for (const StreamEvent &e : events)
        b += e.bytes;
    return b;
}

json device_pcie(size_t device, double h2d, double d2h, double up_ms, double down_ms) {
    json dj;
    dj["device"] = device;
    dj["h2d_bytes"] = h2d;
    dj["d2h_bytes"] = d2h;
    dj["h2d_busy_ms"] = round_to(up_ms, 3);
    dj["d2h_busy_ms"] = round_to(down_ms, 3);
    dj["h2d_gbps_busy"] = up_ms > 0 ? json(round_to(h2d / up_ms / 1e6, 3)) : json(nullptr);
    dj["d2h_gbps_busy"] = down_ms > 0 ? json(round_to(d2h / down_ms / 1e6, 3)) : json(nullptr);
    return dj;
}

} // namespace

Trace parse_trace(const std::string &text) {
    Trace t;
    json j = json::parse(text);
    for (const json &e : j.at("traceEvents")) {
        // Device events carry the job in args; metadata and host spans do not.
        if (e.value("ph", "") != "X" || !e.contains("args") || !e.at("args").contains("job"))
            continue;
        const json &args = e.at("args");
        const size_t id = args.at("job").get<size_t>();
        TraceJob &job = t.jobs[id];
        job.job = id;
        job.stage = args.at("stage").get<size_t>();
        job.kind = args.at("kind").get<std::string>();
        job.device = e.at("pid").get<size_t>();
        const std::string tid = e.at("tid").get<std::string>();
        const double ts = e.at("ts").get<double>() / 1000.0;
        StreamEvent ev{{ts, ts + e.at("dur").get<double>() / 1000.0}, 0.0, false};
        if (tid != "compute") {
            if (!args.contains("bytes"))
                throw BenchError("trace: a '" + tid + "' event of job " + std::to_string(id) +
                                 " has no args.bytes");
            ev.bytes = args.at("bytes").get<double>();
            ev.gradients = args.value("content", "") == "gradients";
        }
        job.streams[tid].push_back(ev);
    }
    return t;
}

PcieBytes pcie_bytes(const Trace &trace) {
    PcieBytes r;
    std::map<size_t, double> dev_h2d, dev_d2h;
    std::map<size_t, std::vector<Span>> up, down;
    std::set<size_t> devices;
    for (const auto &kv : trace.jobs) {
        const TraceJob &j = kv.second;
        devices.insert(j.device);
        for (const auto &st : j.streams) {
            const double b = bytes_of(st.second);
            if (is_upload(st.first)) {
                (st.first == "weights" ? r.h2d_weights : r.h2d_activations) += b;
                dev_h2d[j.device] += b;
                append_spans(up[j.device], st.second);
            } else if (st.first == "download") {
                for (const StreamEvent &e : st.second)
                    (e.gradients ? r.d2h_grads : r.d2h_activations) += e.bytes;
                dev_d2h[j.device] += b;
                append_spans(down[j.device], st.second);
            }
        }
    }
    for (size_t d : devices) {
        const double up_ms = length_of(union_of(up[d])), down_ms = length_of(union_of(down[d]));
        r.h2d_busy_ms += up_ms;
        r.d2h_busy_ms += down_ms;
        r.per_device.push_back(device_pcie(d, dev_h2d[d], dev_d2h[d], up_ms, down_ms));
    }
    return r;
}

json trace_devices(const Trace &trace) {
    std::map<size_t, std::map<std::string, std::vector<Span>>> by_dev;
    for (const auto &kv : trace.jobs)
        for (const auto &st : kv.second.streams)
            append_spans(by_dev[kv.second.device][st.first], st.second);
    json out = json::array();
    for (auto &dv : by_dev) {
        std::vector<Span> compute = union_of(dv.second["compute"]);
        json d;
        d["device"] = dv.first;
        if (compute.empty()) {
            out.push_back(d);
            continue;
        }
        const double window = compute.back().end - compute.front().start;
        const double busy = length_of(compute);
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

double trace_end_ms(const Trace &trace) {
    double end = 0;
    for (const auto &kv : trace.jobs)
        for (const auto &st : kv.second.streams)
            for (const StreamEvent &e : st.second)
                end = std::max(end, e.span.end);
    return end;
}

} // namespace tb
