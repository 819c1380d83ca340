#!/usr/bin/env bash
# A performance change against the commit before it, on the same GPUs in one device call, the
# two sides alternated so that a lease's drift (the host step's time beside a call swung from 469
# to 296 ms within one lease, bench/RESULTS.md round 18) does not favour either.
#
# Here, in the repository (the base as a `git archive` beside the tree, and both sides' names):
#   bash bench/run_ab.sh prepare <base commit>
# writes .ab-base/ (ignored): the base's files and .ab-names, where the tree side is this
# checkout's HEAD, with "+changes" when its tracked files differ. The names are taken here because
# a device machine's copy of the tree can carry an older .git than its files (bench_commit.sh).
#
# On a GPU machine (a device call with carry [".gpu-deps", ".ab-base"]):
#   OUT=/tmp/out bash bench/run_ab.sh run
# runs, each through the side's own bench/run_scaling.sh (which builds its train_bench): the tree
# on one GPU with $AB_ONE_GPU_ARGS (default "--microbatches 4": the ratio's baseline), then
# $AB_ROUNDS rounds (default 2) of the tree and the base on $AB_GPUS GPUs (default 2) with
# $AB_ARGS (default "--microbatches 4 --plan 2,4,14,11", round 17's pinned plan for the
# Qwen3-1.7B shape; a plan left to the re-plan differs from run to run). One JSON line per run in
# $OUT/ab.jsonl, a table of tokens/s, the ratio to the one-GPU run, iteration, forward-backward
# alone and the optimizer step beside a call; the runs' outputs in $OUT/ab-details.tgz. About
# 65 s for the one-GPU run and 45-50 s per two-GPU run on H200s, plus a build of each side.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base=$root/.ab-base
usage() {
  echo "usage: bash bench/run_ab.sh prepare <base commit>   (here)" >&2
  echo "       OUT=<dir> bash bench/run_ab.sh run            (on the GPU machine)" >&2
  exit 2
}

case "${1:-}" in
prepare)
  [ $# -eq 2 ] || usage
  commit=$(git -C "$root" rev-parse --short=7 --verify "$2^{commit}") ||
    { echo "run_ab: '$2' is not a commit here" >&2; exit 2; }
  rm -rf "$base" && mkdir -p "$base"
  git -C "$root" archive "$commit" | tar x -C "$base" || { echo "run_ab: archive failed" >&2; exit 1; }
  tree=$(git -C "$root" describe --always --abbrev=7 --dirty=+changes)
  printf 'ab_base=%s\nab_tree=%s\n' "$commit" "$tree" > "$base/.ab-names"
  echo "run_ab: base $commit in $base, tree $tree; carry [\".gpu-deps\", \".ab-base\"]"
  ;;
run)
  [ -f "$base/.ab-names" ] || { echo "run_ab: no $base/.ab-names: run 'prepare' here first and carry .ab-base" >&2; exit 2; }
  # shellcheck source=/dev/null
  source "$base/.ab-names"
  out=${OUT:-/tmp/rp-ab}
  mkdir -p "$out"
  [ -d "$root/.gpu-deps" ] && [ ! -d "$base/.gpu-deps" ] && cp -r "$root/.gpu-deps" "$base/"
  : > "$out/ab.jsonl"
  one() { # name, side's root, commit, GPUs, train_bench arguments
    echo "[ab] $1: $3 on $4 GPU(s), $5"
    SCALING_GPUS=$4 SCALING_ARGS=$5 BENCH_COMMIT=$3 OUT=$out/$1 \
      bash "$2/bench/run_scaling.sh" > "$out/$1.txt" 2>&1
    cat "$out/$1/scaling.jsonl" >> "$out/ab.jsonl" 2>/dev/null ||
      echo "[ab] $1: no JSON line (see $1.txt)"
  }
  one tree_1gpu "$root" "$ab_tree" 1 "${AB_ONE_GPU_ARGS:---microbatches 4}"
  for r in $(seq "${AB_ROUNDS:-2}"); do
    one "tree_$r" "$root" "$ab_tree" "${AB_GPUS:-2}" "${AB_ARGS:---microbatches 4 --plan 2,4,14,11}"
    one "base_$r" "$base" "$ab_base" "${AB_GPUS:-2}" "${AB_ARGS:---microbatches 4 --plan 2,4,14,11}"
  done
  python3 - "$out/ab.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
one = next((r["tokens_per_s"] for r in rows if r.get("num_devices") == 1 and r.get("tokens_per_s")), None)
print("commit            gpus  tokens/s  ratio  iteration ms  fb alone ms  step beside ms")
for r in rows:
    label = r.get("label", "").split()[0].replace("commit=", "")
    t = r.get("tokens_per_s")
    print("%-17s %4s  %8s  %5s  %12s  %11s  %14s" % (label, r.get("num_devices"), t,
          "%.2f" % (t / one) if t and one else "-", r.get("iter_ms"), r.get("fb_only_ms"),
          r.get("opt_step_ms")))
PY
  ( cd "$out" && tar czf ab-details.tgz tree_* base_* 2>/dev/null && rm -rf tree_* base_* )
  ;;
*) usage ;;
esac
