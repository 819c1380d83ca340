#!/usr/bin/env bash
# Run the whole RoundPipe test suite: C (CMocka), Python, Rust, the ABI gates and the examples,
# all through ctest in the build folder. Configures the build first if needed (run
# scripts/setup.sh once on a new machine), and always brings the build up to date.
#
#   bash scripts/test.sh                 # everything that can run here
#   bash scripts/test.sh -R equivalence  # extra arguments go to ctest
#
# Tests labelled "gpu" run only when nvidia-smi sees a GPU (RP_TEST_GPU=0/1 overrides).
# Then, unless ctest arguments were given or RP_TEST_SANITIZE=0, scripts/sanitize.sh: the fuzz
# targets and the CPU C tests in a second, sanitized build (build-sanitize/).
# Limits: each test has its own TIMEOUT (default 900 s); the whole run RP_TEST_TIMEOUT seconds
# (default 1800). RP_TEST_JOBS: tests run at once (default 2 without a GPU, 1 with one).
# Exits non-zero when any test fails or none was found.
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$RP_ROOT"

rp_cargo_path
rp_select_python use
# Configure when the folder never was, or was configured without the tests or the examples.
if [ ! -f "$RP_BUILD_DIR/CMakeCache.txt" ] ||
    grep -Eq '^RP_BUILD_(TESTS|EXAMPLES):BOOL=(OFF|NO|FALSE|0)$' "$RP_BUILD_DIR/CMakeCache.txt"; then
    rp_torch_info
    rp_cuda_env find
    rp_configure
fi
rp_build

gpu=${RP_TEST_GPU:-}
if [ -z "$gpu" ]; then
    gpu=0
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        gpu=1
    fi
fi
# Without a GPU, tests run RP_TEST_JOBS at a time (default 2): much of the suite is single-threaded
# (Python and pip, cargo, SWIG, process start-up), so two at a time keep a 2-core machine busy.
# With a GPU, one at a time (default), as the GPU tests share the device and its memory.
labels=()
if [ "$gpu" = 1 ]; then
    rp_log "GPU visible: running every test, the gpu label included"
    jobs=${RP_TEST_JOBS:-1}
else
    rp_log "no GPU: leaving out the tests labelled gpu"
    labels=(-LE gpu)
    jobs=${RP_TEST_JOBS:-2}
fi

cd "$RP_BUILD_DIR"
status=0
timeout --kill-after=30 "${RP_TEST_TIMEOUT:-1800}" \
    ctest --output-on-failure --no-tests=error --timeout 900 -j "$jobs" "${labels[@]}" "$@" || status=$?

# Then the sanitizer run (scripts/sanitize.sh): a clang build with ASan + UBSan, each fuzz target
# of tests/fuzz for 60 s, the CPU C tests under the sanitizers. It runs when no ctest arguments
# were given; RP_TEST_SANITIZE=0 skips it, RP_TEST_SANITIZE=1 runs it anyway.
sanitize=${RP_TEST_SANITIZE:-}
if [ -z "$sanitize" ]; then
    sanitize=1
    [ $# -gt 0 ] && sanitize=0
fi
if [ "$sanitize" = 1 ]; then
    cd "$RP_ROOT"
    bash scripts/sanitize.sh || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
else
    rp_log "sanitizer run skipped (RP_TEST_SANITIZE=0 or ctest arguments given)"
fi
exit "$status"
