#include "thread_cpu.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

namespace tb {
namespace {

// utime + stime in clock ticks from a /proc/<pid>/task/<tid>/stat line: fields 14 and 15, the
// 12th and 13th after the parenthesised name (which may hold spaces).
bool ticks_of(const std::string &stat, long long &ticks) {
    const size_t close = stat.rfind(')');
    if (close == std::string::npos)
        return false;
    std::istringstream rest(stat.substr(close + 1));
    std::string skipped;
    for (int i = 0; i < 11; ++i)
        rest >> skipped;
    long long utime = 0, stime = 0;
    if (!(rest >> utime >> stime))
        return false;
    ticks = utime + stime;
    return true;
}

} // namespace

std::map<std::string, ThreadCpu> thread_cpu_by_name() {
    std::map<std::string, ThreadCpu> out;
    DIR *dir = opendir("/proc/self/task");
    if (!dir)
        return out;
    const double ms_per_tick = 1000.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
    while (dirent *entry = readdir(dir)) {
        if (entry->d_name[0] == '.')
            continue;
        const std::string task = std::string("/proc/self/task/") + entry->d_name;
        std::string name, stat;
        std::ifstream comm_file(task + "/comm"), stat_file(task + "/stat");
        long long ticks = 0;
        if (!std::getline(comm_file, name) || !std::getline(stat_file, stat) ||
            !ticks_of(stat, ticks))
            continue; // the thread exited meanwhile
        ThreadCpu &t = out[name];
        t.ms += static_cast<double>(ticks) * ms_per_tick;
        ++t.threads;
    }
    closedir(dir);
    return out;
}

json thread_cpu_between(const std::map<std::string, ThreadCpu> &before,
                        const std::map<std::string, ThreadCpu> &after, double wall_ms) {
    struct Row {
        std::string name;
        double ms;
        int threads;
    };
    std::vector<Row> rows;
    for (const auto &[name, now] : after) {
        const auto was = before.find(name);
        const double ms = now.ms - (was == before.end() ? 0.0 : was->second.ms);
        if (ms > 0)
            rows.push_back({name, ms, now.threads});
    }
    std::sort(rows.begin(), rows.end(), [](const Row &a, const Row &b) { return a.ms > b.ms; });
    json out = json::array();
    for (const Row &r : rows)
        out.push_back({{"name", r.name},
                       {"ms", round_to(r.ms, 1)},
                       {"threads", r.threads},
                       {"cores", wall_ms > 0 ? json(round_to(r.ms / wall_ms, 2)) : json(nullptr)}});
    return out;
}

} // namespace tb
