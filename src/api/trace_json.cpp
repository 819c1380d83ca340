#include "api/trace_json.h"

#include <nlohmann/json.hpp>

namespace rp {

std::vector<std::string> trace_device_names(const Model &model) {
    // Devices are every chosen GPU in index order, or CPU workers only (engine/model.cpp).
    const bool cuda = model.has_cuda_devices();
    std::vector<std::string> names;
    for (size_t i = 0; i < model.num_devices(); ++i)
        names.push_back((cuda ? "cuda:" : "cpu ") + std::to_string(i));
    return names;
}

std::string chrome_trace_json(const std::vector<TraceEvent> &events,
                              const std::vector<std::string> &device_names) {
    using json = nlohmann::json;
    constexpr int kHostPid = 1000; // far above any device index
    json out = json::array();
    for (size_t d = 0; d < device_names.size(); ++d)
        out.push_back({{"name", "process_name"},
                       {"ph", "M"},
                       {"pid", static_cast<int>(d)},
                       {"args", {{"name", device_names[d]}}}});
    out.push_back({{"name", "process_name"},
                   {"ph", "M"},
                   {"pid", kHostPid},
                   {"args", {{"name", "host"}}}});
    for (const TraceEvent &e : events) {
        json event = {{"name", e.name},    {"ph", "X"},           {"ts", e.start_us},
                      {"dur", e.duration_us}, {"tid", e.lane}};
        if (e.device < 0) {
            event["cat"] = "host";
            event["pid"] = kHostPid;
        } else {
            event["cat"] = e.lane;
            event["pid"] = e.device;
            json args = {{"job", e.job}, {"stage", e.stage}, {"kind", e.kind}};
            if (e.bytes >= 0)
                args["bytes"] = e.bytes;
            if (!e.content.empty())
                args["content"] = e.content;
            if (e.enqueued_us >= 0)
                args["enqueued_us"] = e.enqueued_us;
            event["args"] = std::move(args);
        }
        out.push_back(std::move(event));
    }
    return json{{"traceEvents", std::move(out)}, {"displayTimeUnit", "ms"}}.dump();
}

} // namespace rp
