#!/usr/bin/env bash
# Data parallelism on one host (issue 19's measurement): builds train_bench like run_scaling.sh,
# runs it as one process on one device, then as $DP_RANKS ranks (default 2) of one process each,
# rank r on GPU r (CUDA_VISIBLE_DEVICES) with torchrun's environment (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; not torchrun's OMP_NUM_THREADS=1, a
# variant can add it), every run with the same flags: shape $DP_SHAPE (default qwen3-1.7b),
# 8 x 4096 tokens per process, bf16, plus $DP_ARGS (e.g. "--host-memory saving --step-in-call on").
# One JSON line per run in $OUT/data_parallel.jsonl, then tokens/s per rank against the single
# process (the issue's ratio; its target is 0.9 or more); the logs (and traces) in
# $OUT/details.tgz. DP_VARIANTS (see below) runs the ranks again under other environments;
# DP_ROUNDS repeats the whole sequence.
#
#   OUT=/tmp/out DP_ARGS="--host-memory saving --step-in-call on" bash bench/run_data_parallel.sh
#
# DP_DEVICES=cpu runs the same on CPU worker devices (a smoke run of this script: DP_SHAPE=tiny).
# DP_TRACE=1 also writes each run's last training call as a Chrome trace (trace_single.json,
# trace_rank<r>.json) and its bench/trace_summary.py digest (trace_*.summary.json) to $OUT, to
# see where the ranks lose time against the single process.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/rp-data-parallel}
build=${DP_BUILD:-$root/build-gpu}
ranks=${DP_RANKS:-2}
devices=${DP_DEVICES:-cuda}
mkdir -p "$out"
if [ -z "${DP_BUILD:-}" ]; then
  prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  if [ -d "$root/.gpu-deps" ]; then
    prefix="$prefix;$root/.gpu-deps"
    export CMAKE_INCLUDE_PATH=$root/.gpu-deps/include CMAKE_LIBRARY_PATH=$root/.gpu-deps/lib
    export LD_LIBRARY_PATH=$root/.gpu-deps/lib:${LD_LIBRARY_PATH:-}
  fi
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" > "$out/configure.log" 2>&1 &&
    cmake --build "$build" -j"$(nproc)" --target train_bench > "$out/build.log" 2>&1 ||
    { tail -20 "$out/build.log"; echo "SUMMARY: build failed"; exit 1; }
fi
bench=("$build/bench/train_bench" --shape "${DP_SHAPE:-qwen3-1.7b}" --batch 8 --seq 4096
  --microbatches 4 --grain stage --dtype bf16 --devices "$devices" --num-devices 1
  --warmup 3 --steps 6 --fb-only-steps 1 --opt-steps 1 --baseline off)
[ "$devices" = cpu ] && bench+=(--batch 4 --seq 64)
# shellcheck disable=SC2206
extra=(${DP_ARGS:-})
: > "$out/data_parallel.jsonl"
trace_for() { # run name: trace_args = that run's --trace flag when DP_TRACE=1, else nothing
  trace_args=()
  [ "${DP_TRACE:-0}" = 1 ] && trace_args=(--trace "$out/trace_$1.json")
}
# DP_ROUNDS=N (default 1) runs the whole sequence (one process, then the ranks and their
# variants) N times, each round's ratios against its own one-process run, to see whether a
# figure holds from round to round: in round 13 the first two-rank run of a lease was the slowest
# whatever it ran, which round 14 traced to the automatic re-plan (fixed in 0d6f75e).
rounds=${DP_ROUNDS:-1}
for ((k = 1; k <= rounds; k++)); do
  round_tag="" round_label=""
  [ "$rounds" -gt 1 ] && round_tag=_r$k round_label=" (round $k)"
  echo "[data_parallel] one process$round_label"
  trace_for "single$round_tag"
  timeout 600 "${bench[@]}" "${extra[@]}" "${trace_args[@]}" --label "single$round_label" \
    2> "$out/single$round_tag.log" | tail -1 >> "$out/data_parallel.jsonl"
  # The ranks, once per variant: "" (as the process was started), then each entry of $DP_VARIANTS,
  # ';'-separated, each a list of environment assignments for the ranks (e.g.
  # DP_VARIANTS="NCCL_CTA_POLICY=1;NCCL_MAX_CTAS=4": NCCL's kernels beside the compute), so one
  # device call compares them against the same single process.
  IFS=';' read -r -a variants <<< ";${DP_VARIANTS:-}"
  for ((v = 0; v < ${#variants[@]}; v++)); do
    # shellcheck disable=SC2206
    assignments=(${variants[v]})
    [ "$v" -gt 0 ] && [ ${#assignments[@]} -eq 0 ] && continue
    tag=$round_tag
    [ "$v" -gt 0 ] && tag=${tag}_v$v
    suffix=${variants[v]:+ [${variants[v]}]}
    port=$((29500 + RANDOM % 1000))
    echo "[data_parallel] $ranks ranks${suffix}$round_label"
    pids=()
    for ((r = 0; r < ranks; r++)); do
      trace_for "rank$r$tag"
      env "${assignments[@]}" CUDA_VISIBLE_DEVICES=$r RANK=$r LOCAL_RANK=$r WORLD_SIZE=$ranks \
        LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        timeout 600 "${bench[@]}" "${extra[@]}" "${trace_args[@]}" --data-parallel env \
        --label "rank $r of $ranks$suffix$round_label" \
        2> "$out/rank$r$tag.log" > "$out/rank$r$tag.out" &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    for ((r = 0; r < ranks; r++)); do
      tail -1 "$out/rank$r$tag.out" >> "$out/data_parallel.jsonl"
    done
  done
done
python3 "$root/bench/trace_summary.py" --beside "$out"/trace_*.json
python3 - "$out/data_parallel.jsonl" <<'PY'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def round_of(r):  # " (round k)" at the end of the label when DP_ROUNDS > 1
    m = re.search(r"\(round (\d+)\)$", r.get("label") or "")
    return m.group(1) if m else None
base = {round_of(r): r.get("tokens_per_s") for r in rows
        if (r.get("label") or "").startswith("single")}
# window: the call's trace (first to last device work); outside: the call's time beyond it
# (host work after the pipeline); idle: device 0's compute idle share of its window.
print("tokens/s  ratio  iteration  fb alone  step alone  hidden  window  outside  idle   status"
      "  run")
for r in rows:
    t = r.get("tokens_per_s")
    b = base.get(round_of(r))
    dev = (r.get("trace_devices") or [{}])[0]
    print("%8s  %5s  %9s  %8s  %10s  %6s  %6s  %7s  %5s  %-6s  %s" % (
        t, "%.3f" % (t / b) if t and b else "-", r.get("iter_ms"), r.get("fb_only_ms"),
        r.get("opt_step_ms"), r.get("opt_hidden_fraction"), r.get("trace_window_ms"),
        r.get("fb_outside_trace_ms"), dev.get("compute_idle_fraction"), r.get("status"),
        r.get("label")))
PY
# Logs, traces and their digests in one archive (a device call brings back only a few files).
( cd "$out" && shopt -s nullglob && files=(*.log rank*.out trace_*.json) &&
  [ ${#files[@]} -gt 0 ] && tar czf details.tgz "${files[@]}" && rm -f "${files[@]}" )
