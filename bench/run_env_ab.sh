#!/usr/bin/env bash
# Switches of one build against each other (the engine's RP_* environment switches that exist to
# measure what a change gives: RP_OPTIMIZER_BLOCKS, RP_DEFER_TABLE_ROWS, ...), on the same GPUs in
# one device call, in the order given so that variants can be alternated against a lease's drift.
# Where bench/run_ab.sh compares two commits, this compares settings of one tree.
#
#   OUT=/tmp/out AB_VARIANTS="equal:RP_OPTIMIZER_BLOCKS=0 blocks:RP_OPTIMIZER_BLOCKS=1 \
#     equal2:RP_OPTIMIZER_BLOCKS=0 blocks2:RP_OPTIMIZER_BLOCKS=1" bash bench/run_env_ab.sh
#
# Each variant is `name:VAR=value,VAR=value` (no spaces; a value may hold commas). The setting
# `plan=<layers per stage>` (units, as --plan counts them: e.g. plan=3,6,5,5,5,5,5,5 for the
# Qwen3-8B shape's 39, the embedding and the head included) is not an environment variable: it runs
# that variant with `--plan <layers per stage>` after $AB_ARGS; likewise `microbatches=N` with
# `--microbatches N`, and `gpus=N` runs it on N GPUs instead of $AB_GPUS (so that one call can
# hold the one-GPU baseline of a scaling ratio beside the two-GPU runs). Each runs
# bench/run_scaling.sh (which builds train_bench) with SCALING_GPUS=$AB_GPUS (default 2),
# SCALING_SHAPE=$AB_SHAPE (default qwen3-8b), SCALING_ARGS=$AB_ARGS (default: memory-saving,
# registered pinning, in-call steps, 2 warm-up and 3 timed steps) and SCALING_TRACE=1. A variant
# that would start after $AB_STOP_AFTER seconds (default 520, for a device call's 600) is skipped.
# Prints one line per variant (tokens/s, iteration, fb alone, step alone ms, optimizer hidden, peak
# GiB, optimizer ms in the traced call and its rate where the spans name their elements, when its
# first compute started, the plan used) and a second with the cores each named thread group kept
# busy through the timed loop; every run's output in $OUT/env-ab.tgz.
#
# Without two GPUs, `AB_GPUS=1` with `--seq 2048` in AB_ARGS is a stand-in for the two-GPU
# Qwen3-8B call: half the compute, the same optimizer work, so the optimizer sets the pace as it
# does on two GPUs (bench/RESULTS.md, round 24).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/rp-env-ab}
mkdir -p "$out/env-ab"
start=$SECONDS
for variant in ${AB_VARIANTS:?"AB_VARIANTS: name:VAR=value,... per variant"}; do
  name=${variant%%:*}
  settings=()
  # Split at the commas that start a new NAME=, so that a value may hold commas (a plan).
  [ "$variant" != "$name" ] &&
    mapfile -t settings < <(sed -E 's/,([A-Za-z_][A-Za-z0-9_]*=)/\n\1/g' <<< "${variant#*:}")
  args=${AB_ARGS:---host-memory saving --pin register --step-in-call on --warmup 2 --steps 3}
  gpus=${AB_GPUS:-2}
  for i in "${!settings[@]}"; do
    case ${settings[$i]} in
      plan=*) args+=" --plan ${settings[$i]#plan=}"; unset "settings[$i]" ;;
      microbatches=*) args+=" --microbatches ${settings[$i]#microbatches=}"; unset "settings[$i]" ;;
      gpus=*) gpus=${settings[$i]#gpus=}; unset "settings[$i]" ;;
    esac
  done
  if [ $((SECONDS - start)) -gt "${AB_STOP_AFTER:-520}" ]; then
    echo "$name: skipped (past AB_STOP_AFTER)"
    continue
  fi
  dir=$out/env-ab/$name
  mkdir -p "$dir"
  env "${settings[@]}" OUT="$dir" SCALING_GPUS="$gpus" SCALING_SHAPE="${AB_SHAPE:-qwen3-8b}" \
    SCALING_TRACE=1 SCALING_ARGS="$args" \
    bash "$root/bench/run_scaling.sh" > "$dir.log" 2>&1
  python3 - "$dir" "$name" <<'PY'
import glob, json, re, sys
d, name = sys.argv[1], sys.argv[2]
for line in open(f"{d}/scaling.jsonl"):
    r = json.loads(line)
    opt = first = rate = "-"
    for t in glob.glob(f"{d}/trace_*.json"):
        if t.endswith(".summary.json"):  # trace_summary.py's digest beside the trace
            continue
        ev = json.load(open(t))
        ev = ev["traceEvents"] if isinstance(ev, dict) else ev
        spans = [e for e in ev if e.get("ph") == "X"]
        updates = [e for e in spans if e.get("tid") == "optimizer"]
        opt = round(sum(e["dur"] for e in updates) / 1e3)
        # The optimizer's rate in the call: elements over the spans that name them.
        named = [(int(m.group(1)), e["dur"]) for e in updates
                 for m in [re.search(r"(\d+) elements", e.get("name", ""))] if m]
        if named and sum(d for _, d in named):
            rate = round(sum(n for n, _ in named) / sum(d for _, d in named) / 1e3, 2)
        # When the devices start computing (the previous step's first stages updated and up).
        first = round((min(e["ts"] for e in spans if e.get("tid") == "compute") -
                       min(e["ts"] for e in spans)) / 1e3, 1)
    peak = round(r.get("peak_gpu_bytes", 0) / 2**30, 1)
    # Cores each named thread group kept busy through the timed loop (the engine's rp-* threads).
    cores = ", ".join(f"{t['name']} {t['cores']}" for t in r.get("loop_thread_cpu", [])[:6])
    print(f"{name:10} {r.get('tokens_per_s')} tok/s  iter {r.get('iter_ms')}  fb alone {r.get('fb_only_ms')}  "
          f"step alone {r.get('opt_step_ms')}  hidden {r.get('opt_hidden_fraction')}  peak {peak} GiB  optimizer in call {opt} ms ({rate} G elements/s)  first compute {first} ms  plan {r.get('pcie_plan')}")
    print(f"{'':10} cores busy: {cores}")
PY
  echo "  ($((SECONDS - start)) s)"
done
tar czf "$out/env-ab.tgz" -C "$out" env-ab && rm -rf "$out/env-ab"
