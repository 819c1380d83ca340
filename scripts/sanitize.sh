#!/usr/bin/env bash
# The sanitizer run, called by scripts/test.sh (RP_TEST_SANITIZE=0 skips it there): configures a
# second build folder with clang, AddressSanitizer + UndefinedBehaviorSanitizer and libFuzzer
# (-DRP_FUZZ=ON), builds the library, the C tests and the fuzz targets (nothing else), then
#   1. runs each fuzz target of tests/fuzz for RP_FUZZ_SECONDS over its seeds
#      (tests/fuzz/corpus/<target>, tests/fuzz/regressions/<target>);
#   2. runs the CPU C tests (ctest -L cpu -R '^c_') under the same sanitizers.
# Exits non-zero when a fuzz target finds a crash, a leak, a sanitizer report, a timeout or an
# RP_ERR_INTERNAL, or when a test fails. Needs clang, libclang-rt-14-dev, libomp-dev and llvm
# (scripts/setup.sh installs them).
#
#   bash scripts/sanitize.sh                      # everything
#   RP_FUZZ_SECONDS=600 bash scripts/sanitize.sh fuzz_load   # one target, longer; no C tests
#
# Arguments: fuzz target names to run (default: all, then the C tests). Knobs (environment):
#   RP_SANITIZE_DIR   build folder (default: <repo>/build-sanitize)
#   RP_FUZZ_SECONDS   seconds per fuzz target (default 60; 0 replays the seeds only)
#   RP_FUZZ_JOBS      fuzz targets run at once (default 2)
#   RP_FUZZ_RSS_MB    libFuzzer's memory limit per process (default 3072)
#   RP_FUZZ_ALLOC_MB  largest single allocation; bigger ones fail (return NULL) (default 128: a
#                     valid config of a few 400 MB tensors would otherwise pass the library's
#                     host check and exceed the 3 GB RSS limit of the fuzzer, a harness OOM)
#   RP_HOST_MEMORY_LIMIT_MB  host memory the library assumes it may use while fuzzed (default 1024):
#                     many allocations under RP_FUZZ_ALLOC_MB each can still add up past the RSS
#                     limit; under this limit such a model is refused by the library's host check
#   RP_JOBS, RP_TEST_JOBS, CUDA_HOME, PYTHON as for scripts/test.sh.
# A failing input is left in <build>/fuzz/<target>/ (crash-*, leak-*, timeout-*, oom-*): copy it
# into tests/fuzz/regressions/<target>/ so that every later run replays it.
set -uo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$RP_ROOT" || exit 1

dir=${RP_SANITIZE_DIR:-$RP_ROOT/build-sanitize}
seconds=${RP_FUZZ_SECONDS:-60}
all_targets=(fuzz_spec fuzz_hf_config fuzz_hf_dir fuzz_load)
targets=("$@")
run_tests=0
if [ ${#targets[@]} -eq 0 ]; then
    targets=("${all_targets[@]}")
    run_tests=1
fi

for tool in clang clang++; do
    command -v "$tool" >/dev/null 2>&1 || rp_die "$tool not found (run scripts/setup.sh)"
done
rp_select_python use
if [ ! -f "$dir/CMakeCache.txt" ]; then
    rp_torch_info
    rp_cuda_env find
    # -O1 with line tables: fast enough to fuzz, exact enough for stack traces; no NDEBUG, so
    # assertions stay on. Examples and benchmarks are left out.
    rp_log "configuring $dir (clang, ASan + UBSan, libFuzzer)"
    rp_locked cmake -S "$RP_ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
        "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
        "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
        "-DCMAKE_PREFIX_PATH=$RP_TORCH_PREFIX" -DRP_SANITIZE=ON -DRP_FUZZ=ON \
        -DRP_BUILD_TESTS=ON -DRP_BUILD_EXAMPLES=OFF -DRP_BUILD_BENCH=OFF ||
        rp_die "configuring $dir failed"
fi
# Only what runs below: the fuzz targets and the C tests' executables (with the library they
# link), not the C++ engine and kernel tests, the Python or Rust suites, which run unsanitized.
rp_log "building the fuzz targets and the C tests in $dir with $RP_JOBS jobs"
rp_locked cmake --build "$dir" -j "$RP_JOBS" --target rp_fuzz_targets rp_c_tests ||
    rp_die "building $dir failed"

# Sanitizer settings. libtorch is not instrumented but its allocations go through ASan's
# allocator: allocator_may_return_null + max_allocation_size_mb turn an allocation too large for
# the fuzzing budget into a failed malloc (libtorch then throws, and the library must return a
# status) rather than an out-of-memory report. protect_shadow_gap=0 lets CUDA map its memory
# where a GPU is visible. LeakSanitizer ignores libtorch's and OpenMP's process-lifetime caches
# (tests/fuzz/lsan.supp).
symbolizer=$(command -v llvm-symbolizer || true)
export ASAN_OPTIONS="detect_leaks=1:protect_shadow_gap=0:allocator_may_return_null=1:max_allocation_size_mb=${RP_FUZZ_ALLOC_MB:-128}:detect_stack_use_after_return=0:strict_string_checks=1:check_initialization_order=1:abort_on_error=0${symbolizer:+:external_symbolizer_path=$symbolizer}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:report_error_type=1"
export LSAN_OPTIONS="suppressions=$RP_ROOT/tests/fuzz/lsan.supp:print_suppressions=0"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RP_OPTIMIZER_THREADS=${RP_OPTIMIZER_THREADS:-1}

# One fuzz target for $seconds s over its seeds; its verdict, one line, goes to
# <build>/fuzz/<target>/verdict (the targets run side by side, so each writes its own).
fuzz_target() {
    local target=$1
    local bin=$dir/tests/fuzz/$target work=$dir/fuzz/$target
    mkdir -p "$work/corpus"
    rm -f "$work/verdict"
    local seeds=("$RP_ROOT/tests/fuzz/corpus/$target")
    [ -d "$RP_ROOT/tests/fuzz/regressions/$target" ] && seeds+=("$RP_ROOT/tests/fuzz/regressions/$target")
    local dict=()
    [ -f "$RP_ROOT/tests/fuzz/$target.dict" ] && dict=("-dict=$RP_ROOT/tests/fuzz/$target.dict")
    local log=$work/fuzz.log
    rp_log "fuzzing $target for $seconds s (log: $log)"
    local t0=$SECONDS
    # New inputs go to $work/corpus (kept between local runs), never into the repository.
    # -timeout: seconds per input; the outer timeout is a guard against a hang in libFuzzer itself.
    local limit=(-runs=0)
    [ "$seconds" -gt 0 ] && limit=(-max_total_time="$seconds")
    RP_HOST_MEMORY_LIMIT_MB=${RP_HOST_MEMORY_LIMIT_MB:-1024} \
        timeout --kill-after=30 $((seconds + 300)) "$bin" "${limit[@]}" -timeout=30 \
        -rss_limit_mb="${RP_FUZZ_RSS_MB:-3072}" -max_len=16384 -print_final_stats=1 \
        -artifact_prefix="$work/" "${dict[@]}" "$work/corpus" "${seeds[@]}" >"$log" 2>&1
    local rc=$?
    local runs
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    if [ $rc -eq 0 ]; then
        echo "$target: ok, ${runs:-?} runs in $((SECONDS - t0)) s" >"$work/verdict"
    else
        echo "$target: FAILED (exit $rc) after ${runs:-?} runs, see $log" >"$work/verdict"
        {
            rp_log "$target failed; the end of its log:"
            grep -v '^#[0-9]' "$log" | tail -60
            ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* 2>/dev/null |
                sed 's/^/[roundpipe]   failing input: /'
        } >&2
    fi
}

failed=()
summary=()
for target in "${targets[@]}"; do
    [ -x "$dir/tests/fuzz/$target" ] || rp_die "no fuzz target $dir/tests/fuzz/$target"
done
# RP_FUZZ_JOBS targets at once (default 2): each fuzzer is one single-threaded process (libtorch
# and the optimizer are held to one thread above), so on 2 cores two run side by side at full
# speed and the four take half the time.
running=0
for target in "${targets[@]}"; do
    fuzz_target "$target" &
    running=$((running + 1))
    if [ "$running" -ge "${RP_FUZZ_JOBS:-2}" ]; then
        wait -n
        running=$((running - 1))
    fi
done
wait
for target in "${targets[@]}"; do
    verdict=$(cat "$dir/fuzz/$target/verdict" 2>/dev/null || echo "$target: FAILED (no verdict)")
    summary+=("$verdict")
    [[ $verdict == "$target: ok"* ]] || failed+=("$target")
done

if [ $run_tests = 1 ]; then
    rp_log "running the CPU C tests under ASan + UBSan"
    t0=$SECONDS
    # Sanitized tests run a few times slower; ctest's per-test TIMEOUTs stay as they are. Two at a
    # time (RP_TEST_JOBS), as in scripts/test.sh: CPU tests only, so no GPU is shared.
    if timeout --kill-after=30 "${RP_SANITIZE_TEST_TIMEOUT:-1800}" \
        ctest --test-dir "$dir" -L cpu -R '^c_' --output-on-failure --no-tests=error -j "${RP_TEST_JOBS:-2}" \
        >"$dir/c_tests.log" 2>&1; then
        summary+=("C tests: ok ($(grep -E 'tests passed' "$dir/c_tests.log" | tail -1)) in $((SECONDS - t0)) s")
    else
        failed+=("C tests")
        summary+=("C tests: FAILED, see $dir/c_tests.log")
        grep -E -A40 'Failed|\*\*\*|ERROR: (Address|Leak)Sanitizer|runtime error' "$dir/c_tests.log" |
            tail -120 >&2
    fi
fi

for line in "${summary[@]}"; do rp_log "sanitize: $line"; done
if [ ${#failed[@]} -gt 0 ]; then
    rp_log "sanitize: FAILED: ${failed[*]}"
    exit 1
fi
rp_log "sanitize: all passed"
