// The JSON line: every field bench/RESULTS.md describes, from the options, the baseline's
// result, the RoundPipe run and its trace; and the smoke checks of --check.
#pragma once

#include <cstdint>

#include "baseline.h"
#include "options.h"
#include "roundpipe_run.h"
#include "util.h"

namespace tb {

// bench ... host_threads: what was asked for, before anything runs.
json report_header(const Options &o);

// host_bytes_estimate (the engine's bytes per parameter times the parameters) and
// host_mem_available_bytes.
void report_host_memory(json &out, double need, int64_t available);

// status "skipped" with the reason: the host state would not fit.
void report_host_skip(json &out, double bytes_per_param, double need, int64_t available);

// baseline_* fields, as far as the baseline got.
void report_baseline(json &out, const Options &o, const BaselineResult &b);

// The RoundPipe fields, as far as the run got (creation fields once the model exists, the rest
// once it finished).
void report_roundpipe(json &out, const Options &o, const RoundPipeRun &r);

// ratio_vs_baseline.
void report_ratio(json &out);

// --check: marks `status` "check failed: ..." and returns false when a smoke check fails.
bool report_checks(json &out, const Options &o, const RoundPipeRun &r);

} // namespace tb
