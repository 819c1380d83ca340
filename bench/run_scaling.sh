#!/usr/bin/env bash
# Multi-GPU scaling (issue 8's measurement on the GPU counts at hand): builds train_bench like
# run_gpu_bench.sh, then runs it on each GPU count in $SCALING_GPUS (default "1 2"), shape
# $SCALING_SHAPE (default qwen3-1.7b), batch 8 x 4096, bf16, stage grain, 8 microbatches (>= GPUs
# + 1 up to 7 GPUs), default memory cap, no baseline, plus $SCALING_ARGS (e.g. the 8B needs
# "--host-memory saving --pin register"; fewer steps: "--warmup 1 --steps 2"). One JSON line per
# count (and plan) in $OUT/scaling.jsonl, then a table; the logs in $OUT/details.tgz.
#
#   OUT=/tmp/out SCALING_GPUS="1 2 4" BENCH_COMMIT=<sha> bash bench/run_scaling.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/rp-scaling}
build=$root/build-gpu
mkdir -p "$out"
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
if [ -d "$root/.gpu-deps" ]; then
  prefix="$prefix;$root/.gpu-deps"
  export CMAKE_INCLUDE_PATH=$root/.gpu-deps/include CMAKE_LIBRARY_PATH=$root/.gpu-deps/lib
  export LD_LIBRARY_PATH=$root/.gpu-deps/lib:${LD_LIBRARY_PATH:-}
fi
# shellcheck source=bench/bench_commit.sh
source "$root/bench/bench_commit.sh"
label="commit=$commit date=$(date -u +%Y-%m-%dT%H:%MZ) gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l)"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" > "$out/configure.log" 2>&1 &&
  cmake --build "$build" -j"$(nproc)" --target train_bench > "$out/build.log" 2>&1 ||
  { tail -20 "$out/build.log"; echo "SUMMARY: build failed"; exit 1; }
: > "$out/scaling.jsonl"
# SCALING_PLANS: stage plans to run on each count above one GPU besides the automatic one
# (space-separated, each a comma list of layers per stage covering every unit of the model, e.g.
# "8,8,8,7 3,5,12,11" for the Qwen3-1.7B shape's 31), to compare the planner's choice with them.
# RP_LOG_LEVEL=info puts the re-plan's line (measured stage times, the fused call modelled
# before and after) in each run's log. SCALING_TRACE=1 also writes each run's last training call
# as a Chrome trace ($OUT/trace_<gpus>[<plan>].json) and its bench/trace_summary.py digest
# (.summary.json beside it), to see where a count loses time against one GPU, and the last call
# without a step in flight ($OUT/alone_trace_<gpus>[<plan>].json, train_bench --trace-alone), to
# see what a step inside the calls costs them.
for g in ${SCALING_GPUS:-1 2}; do
  plans=(auto)
  [ "$g" -gt 1 ] && plans+=(${SCALING_PLANS:-})
  for plan in "${plans[@]}"; do
    echo "[scaling] $g GPU(s), plan $plan"
    log=$out/scaling_$g${plan/#auto/}.log
    trace_args=()
    trace=$out/trace_$g${plan/#auto/}.json
    # and the last call without a step in flight beside it (alone_trace_*, outside trace_*'s glob)
    [ "${SCALING_TRACE:-0}" = 1 ] && trace_args=(--trace "${trace//,/-}"
      --trace-alone "$(dirname "$trace")/alone_$(basename "${trace//,/-}")")
    RP_LOG_LEVEL=${RP_LOG_LEVEL:-info} timeout 300 "$build/bench/train_bench" \
      --shape "${SCALING_SHAPE:-qwen3-1.7b}" --batch 8 \
      --seq 4096 --microbatches 8 --grain stage --dtype bf16 --devices cuda --num-devices "$g" \
      --warmup 3 --steps 6 --fb-only-steps 1 --opt-steps 1 --baseline off --plan "$plan" \
      ${SCALING_ARGS:-} "${trace_args[@]}" --label "$label gpus=$g plan=$plan" \
      2> "${log//,/-}" | tail -1 >> "$out/scaling.jsonl"
  done
done
python3 "$root/bench/trace_summary.py" --beside "$out"/trace_*.json "$out"/alone_trace_*.json
python3 - "$out/scaling.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = next((r["tokens_per_s"] for r in rows if r.get("num_devices") == 1 and r.get("tokens_per_s")), None)
print("gpus  tokens/s  speedup  efficiency  peak GiB  status  plan (asked: used)  fb alone  window  idle per device")
for r in rows:
    t = r.get("tokens_per_s")
    n = r.get("num_devices") or 0
    s = t / base if t and base else None
    print("%4s  %8s  %7s  %10s  %8s  %s" % (n, t, "%.2f" % s if s else "-",
          "%.2f" % (s / n) if s and n else "-",
          "%.1f" % (r["peak_gpu_bytes"] / 2**30) if r.get("peak_gpu_bytes") else "-",
          r.get("status"), ), " %s: %s" % (r.get("plan"), r.get("pcie_plan")), r.get("fb_only_ms"),
          r.get("trace_window_ms"), [d.get("compute_idle_fraction") for d in r.get("trace_devices") or []])
PY
( cd "$out" && shopt -s nullglob && files=(*.log) && [ ${#files[@]} -gt 0 ] &&
  tar czf details.tgz "${files[@]}" && rm -f "${files[@]}" )
