#!/usr/bin/env bash
# The benchmark run of issue 7, in one command for a lent GPU machine (one H200): builds the two
# benchmark programs like scripts/gpu-check.sh does (same build folder, build-gpu), then runs
#   1. qwen3-8b, batch 8 x 4096, bf16, memory-saving host mode (12 bytes/parameter), no baseline;
#   2. qwen3-1.7b, batch 8 x 4096, bf16, 8 microbatches, layer grain, GPU memory cap 10 GiB, with
#      the plain libtorch baseline in the same process and the trace of one iteration;
#   3. the same in memory-saving mode, without the baseline;
#   4. the CPU AdamW micro-benchmark on 2.5e8 parameters (fp32 state, and the saving mode's
#      bf16-state kernel);
# stopping before a run when the time budget (BENCH_BUDGET_S, default 540 s from the start) is
# spent. Each run is also bounded by its own timeout.
#
# Output in $OUT (default /tmp/rp-gpu-bench): results.jsonl (one JSON line per run, the format
# bench/RESULTS.md describes), <run>.log (progress), trace_qwen3-1.7b.json (Chrome trace of the
# last timed iteration of run 1) and its summary, machine.txt, build logs. The last line printed
# is a summary.
#
#   OUT=/tmp/out BENCH_COMMIT=$(git rev-parse --short HEAD) bash bench/run_gpu_bench.sh
# Knobs: BENCH_COMMIT (recorded in every line's label; default: see bench/bench_commit.sh),
#        BENCH_BUDGET_S (default 540), BENCH_STEPS (timed steps of the 1.7B runs, default 6),
#        BENCH_8B_ARGS (extra train_bench flags for the 8B run).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/rp-gpu-bench}
build=$root/build-gpu
budget=${BENCH_BUDGET_S:-540}
steps=${BENCH_STEPS:-6}
mkdir -p "$out"
t0=$SECONDS
say() { echo "[run_gpu_bench +$((SECONDS - t0))s] $*"; }

prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
if [ -d "$root/.gpu-deps" ]; then
  deps=$root/.gpu-deps
  prefix="$prefix;$deps"
  export CMAKE_INCLUDE_PATH=$deps/include CMAKE_LIBRARY_PATH=$deps/lib
  export LD_LIBRARY_PATH=$deps/lib:${LD_LIBRARY_PATH:-}
fi

# shellcheck source=bench/bench_commit.sh
source "$root/bench/bench_commit.sh"
date_utc=$(date -u +%Y-%m-%dT%H:%MZ)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
{
  echo "date: $date_utc"
  echo "commit: $commit"
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv,noheader 2>&1
  python3 -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores visible"
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
} > "$out/machine.txt"
say "machine: $(tr '\n' ';' < "$out/machine.txt")"
label="commit=$commit date=$date_utc gpu=${gpu:-none}"

say "configure and build (train_bench, adamw_bench)"
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" > "$out/configure.log" 2>&1; then
  echo "SUMMARY: configure failed, see configure.log"; exit 1
fi
if ! cmake --build "$build" -j"$(nproc)" --target train_bench adamw_bench > "$out/build.log" 2>&1; then
  tail -20 "$out/build.log"; echo "SUMMARY: build failed, see build.log"; exit 1
fi
say "built"

results=$out/results.jsonl
: > "$results"
ran=0 failed=0 skipped_budget=0
# run NAME TIMEOUT_S COMMAND...: one JSON line on stdout goes to results.jsonl, progress to
# NAME.log; the JSON line is echoed with a one-line digest.
run() {
  local name=$1 limit=$2; shift 2
  if [ $((SECONDS - t0 + 30)) -gt "$budget" ]; then
    say "$name: not run, time budget ($budget s) spent"; skipped_budget=$((skipped_budget + 1)); return
  fi
  say "$name: $*"
  local line rc
  timeout --kill-after=20 "$limit" "$@" > "$out/$name.json" 2> "$out/$name.log"
  rc=$?
  line=$(tail -1 "$out/$name.json")
  ran=$((ran + 1))
  if [ -z "$line" ]; then
    line="{\"bench\":\"$name\",\"status\":\"no output (exit $rc, timeout $limit s)\",\"label\":\"$label\"}"
  fi
  echo "$line" >> "$results"
  [ "$rc" = 0 ] || failed=$((failed + 1))
  echo "$line"
  python3 - "$line" <<'EOF'
import json, sys
d = json.loads(sys.argv[1])
g = lambda k: d.get(k)
gib = lambda v: None if v is None else round(v / 2**30, 2)
if d.get("bench") == "train":
    print(f"  -> {d.get('shape')} status={g('status')} tokens/s={g('tokens_per_s')} "
          f"peak_gpu_GiB={gib(g('peak_gpu_bytes'))} baseline tokens/s={g('baseline_tokens_per_s')} "
          f"(peak {gib(g('baseline_peak_gpu_bytes'))} GiB, {g('baseline_status')}) "
          f"ratio={g('ratio_vs_baseline')} opt_hidden={g('opt_hidden_fraction')} "
          f"host_RSS_B/param={g('host_bytes_per_param')} state_B/param={g('host_state_bytes_per_param')} "
          f"h2d GB/s busy={g('pcie_h2d_gbps_busy')}")
elif d.get("bench") == "adamw":
    print(f"  -> adamw ours {g('ours_gparams_per_s')} Gparam/s, fused {g('fused_gparams_per_s')}, "
          f"torch {g('torch_adamw_gparams_per_s')}, speedup vs fused {g('speedup_vs_fused')}, "
          f"{g('ours_fraction_of_copy_bw')} of memcpy bandwidth; bf16 state {g('bf16_state_gparams_per_s')}")
EOF
}

tb=$build/bench/train_bench
common=(--batch 8 --seq 4096 --microbatches 4 --grain stage --dtype bf16 --devices cuda)

# Qwen3-8B first (the run this host could not hold before the memory-saving mode): 12 bytes of
# host state per parameter, weights page-locked in place (no power-of-two padding), no baseline
# (its 131 GB of GPU state does not fit on one H200).
run qwen3-8b-saving 330 "$tb" --shape qwen3-8b --batch 8 --seq 4096 --dtype bf16 --devices cuda \
  --microbatches 8 --grain stage --host-memory saving --pin register \
  --warmup 2 --steps 3 --fb-only-steps 1 --opt-steps 1 --baseline off \
  --trace "$out/trace_qwen3-8b.json" --label "$label" ${BENCH_8B_ARGS:-}

# Under the 10 GiB cap: 8 microbatches of 4096 tokens and layer-grain recompute keep the
# activations of one layer at a time (BENCH_CAPPED_ARGS overrides).
capped=(--batch 8 --seq 4096 --dtype bf16 --devices cuda ${BENCH_CAPPED_ARGS:---microbatches 8 --grain layer})
run qwen3-1.7b 240 "$tb" --shape qwen3-1.7b "${capped[@]}" --gpu-cap-gib 10 \
  --warmup 3 --steps "$steps" --fb-only-steps 2 --opt-steps 2 \
  --baseline on --baseline-warmup 2 --baseline-steps 5 \
  --trace "$out/trace_qwen3-1.7b.json" --label "$label cap=10GiB"
if [ -s "$out/trace_qwen3-1.7b.json" ]; then
  python3 "$root/bench/trace_summary.py" "$out/trace_qwen3-1.7b.json" > "$out/trace_qwen3-1.7b.summary.json" &&
    say "trace summary: $(cat "$out/trace_qwen3-1.7b.summary.json")"
fi

run qwen3-1.7b-saving 180 "$tb" --shape qwen3-1.7b "${capped[@]}" --gpu-cap-gib 10 \
  --host-memory saving --warmup 3 --steps "$steps" --fb-only-steps 2 --opt-steps 2 \
  --baseline off --trace "$out/trace_qwen3-1.7b-saving.json" --label "$label cap=10GiB saving"

run adamw 120 "$build/bench/adamw_bench" --params 2.5e8 --tensors 16 --reps 5 --label "$label"

say "done"
echo "SUMMARY: $ran run(s), $failed with a non-zero exit, $skipped_budget not run (budget); results in $results; $(head -3 "$out/machine.txt" | tail -1)"
[ "$failed" = 0 ]
