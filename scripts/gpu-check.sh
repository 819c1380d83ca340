#!/usr/bin/env bash
# The whole GPU check, in one command for a lent GPU machine: configure against PyTorch's
# libtorch, build with CUDA, run the gpu-labelled tests, the CPU suite with a GPU visible, and
# the C example on the GPU, then the gpu-labelled tests once more under compute-sanitizer (memcheck,
# then racecheck). Logs go to $OUT (or /tmp/rp-gpu-check); the last line is a summary.
#
# compute-sanitizer is looked for in $COMPUTE_SANITIZER, on PATH, in $CUDA_HOME/bin and
# /usr/local/cuda/bin, in .compute-sanitizer/ (NVIDIA's nvidia-cuda-sanitizer-api wheel for torch's
# CUDA major version, unzipped there, or the wheel itself, which is unpacked and then preferred;
# an ignored folder a device call can carry), and in the
# wheel's place in python3's site-packages. RP_GPU_SANITIZE=0 skips that step;
# RP_GPU_SANITIZE_TESTS (a ctest -R regex) narrows it; RP_GPU_SANITIZE_TIMEOUT (seconds, default
# 1800) bounds each tool's run; RP_GPU_SANITIZE_TOOLS (default "memcheck racecheck") picks the
# tools; RP_GPU_SANITIZE_API_ERRORS (default explicit) is memcheck's --report-api-errors.
# RP_GPU_SKIP, a comma-separated list of step names (gpu_tests, cpu_tests, example_gpu,
# python_lora_gpu, data_parallel_gpu), leaves steps out, so that one device call can spend its
# time on the sanitizer alone.
# RP_GPU_SANITIZE_EXCLUDE, a compute-sanitizer kernel filter (e.g. "regex=gemm|nvjet"), leaves
# matching kernels uninstrumented: racecheck runs the transformer tests' vendor GEMM and attention
# kernels (cuBLAS, cuDNN, flash; closed source, and the bulk of the instrumented time) for hours.
# RP_GPU_SANITIZE_INCLUDE, a filter of the same form, instruments only the matching kernels (e.g.
# "regex=rp::kernels|2rp7kernels|at::native|2at6native": ours and ATen's, by demangled or mangled
# name). Unset, racecheck instruments our kernels only (src/kernels, namespace rp::kernels):
# racecheck finds shared-memory hazards inside a kernel, so only our kernels' races are ours to
# fix, and instrumenting the vendor and ATen kernels of the transformer tests takes longer than a
# device call (CUDA 13.0's racecheck also failed internally on bf16 cuBLAS kernels). memcheck
# instruments every kernel unless told otherwise.
# Before each tool's run of the tests, tests/gpu/sanitizer_control.cu (a shared-memory race, a
# write past an allocation) runs under the same tool and filters, and must be reported: so "0
# errors" cannot come from a tool that never attached or a filter that matched nothing.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/rp-gpu-check}
build=$root/build-gpu
mkdir -p "$out"

prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
if [ -d "$root/.gpu-deps" ]; then
  deps=$root/.gpu-deps
  prefix="$prefix;$deps"
  export CMAKE_INCLUDE_PATH=$deps/include CMAKE_LIBRARY_PATH=$deps/lib
  export LD_LIBRARY_PATH=$deps/lib:${LD_LIBRARY_PATH:-}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
python3 -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' >> "$out/gpu.txt" 2>&1

status=ok
step() { # name, command...
  local name=$1; shift
  if [[ ",${RP_GPU_SKIP:-}," == *",$name,"* ]]; then echo "$name: skipped (RP_GPU_SKIP)"; return 0; fi
  local t0=$SECONDS
  if "$@" > "$out/$name.log" 2>&1; then echo "$name: ok ($((SECONDS - t0)) s)"; else echo "$name: FAILED ($((SECONDS - t0)) s), see $name.log"; status=failed; return 1; fi
}

step configure cmake -S "$root" -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" &&
step build cmake --build "$build" -j"$(nproc)" || { echo "SUMMARY: gpu-check build failed"; exit 1; }
export RP_TRACE_OUT=$out/trace_4x_cap.json
step gpu_tests ctest --test-dir "$build" -L gpu --output-on-failure
[ -f "$RP_TRACE_OUT" ] && python3 "$root/bench/trace_summary.py" "$RP_TRACE_OUT" > "$out/trace_summary.json" &&
  echo "trace of the 4x-cap model: $(cat "$out/trace_summary.json")"
# The CPU suite again, now with a GPU visible: CPU devices must still be chosen where asked for.
# Rust needs cargo, the ABI gate SWIG and the install tests PyPI and cargo, which the GPU
# machines lack; CI runs them.
step cpu_tests ctest --test-dir "$build" -L cpu -E '^(rust|abi_gate|install_.*)$' -j8 --output-on-failure
step example_gpu "$build/examples/c/train_mlp" --device auto
# LoRA from Python against transformers + PEFT with the engine on a GPU. PEFT is pure Python: where
# the machine lacks it, a copy in .gpu-deps/python (peft and accelerate, an ignored folder a device
# call can carry) is used.
py_path=$root/bindings/python
[ -d "$root/.gpu-deps/python" ] && py_path=$py_path:$root/.gpu-deps/python
if PYTHONPATH=$py_path python3 -c 'import peft' > /dev/null 2>&1; then
  step python_lora_gpu env RP_TEST_DEVICE=cuda ROUNDPIPE_LIBRARY="$build/libroundpipe.so" \
    PYTHONPATH="$py_path" python3 -m pytest -q "$root/tests/python/test_lora_native.py"
else
  echo "python_lora_gpu: skipped (peft cannot be imported)"
fi
# Data parallelism on the GPUs (NCCL): two ranks, one GPU each, against one process on the whole
# batch. Needs two GPUs (and the gloo headers, e.g. in .gpu-deps/include/gloo).
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  step data_parallel_gpu env RP_TEST_DEVICE=cuda "$build/tests/test_data_parallel"
else
  echo "data_parallel_gpu: skipped (fewer than 2 GPUs)"
fi

# The gpu tests under compute-sanitizer, once per tool. Each process writes its own report
# (sanitizer_<tool>.<pid>.txt); a test with an error exits 1 (--error-exitcode), so ctest's own
# log names it. The libtorch caching allocator stays on (the memory-cap tests need it), so
# memcheck sees overruns of whole allocations, not of tensors inside one. RP_TEST_UNDER_SANITIZER
# tells the tests; the one that only measures numerics over hundreds of steps skips itself.
find_compute_sanitizer() {
  local c site
  site=$(python3 -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
  for c in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
      "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer \
      "$root"/.compute-sanitizer/nvidia/cu*/bin/compute-sanitizer \
      "$root"/.compute-sanitizer/bin/compute-sanitizer "$site"/nvidia/cu*/bin/compute-sanitizer; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}
# A sanitizer wheel carried in .compute-sanitizer/ (scripts/gpu-deps.sh fetches one: a newer
# compute-sanitizer than the machine's) is unpacked there and, being a deliberate choice, used
# unless COMPUTE_SANITIZER names another.
unpack_sanitizer_wheel() {
  local dir=$root/.compute-sanitizer w bin
  for w in "$dir"/nvidia_cuda_sanitizer_api-*.whl; do
    [ -f "$w" ] || continue
    [ -d "$dir/nvidia" ] || python3 -m zipfile -e "$w" "$dir" || return 0
    chmod -R u+x "$dir"/nvidia/cu*/bin "$dir"/nvidia/cu*/compute-sanitizer 2>/dev/null
    for bin in "$dir"/nvidia/cu*/bin/compute-sanitizer; do
      [ -x "$bin" ] && export COMPUTE_SANITIZER=${COMPUTE_SANITIZER:-$bin}
    done
    return 0
  done
}
[ "${RP_GPU_SANITIZE:-1}" = 0 ] || unpack_sanitizer_wheel
sanitizer_line="not run"
if [ "${RP_GPU_SANITIZE:-1}" = 0 ]; then
  sanitizer_line="skipped (RP_GPU_SANITIZE=0)"
elif ! cs=$(find_compute_sanitizer); then
  sanitizer_line="compute-sanitizer not found"
  echo "compute-sanitizer: not found (see the head of this script)"
  status=failed
else
  "$cs" --version > "$out/sanitizer_version.txt" 2>&1
  sanitizer_line=""
  for tool in ${RP_GPU_SANITIZE_TOOLS:-memcheck racecheck}; do
    rm -f "$out/sanitizer_$tool".*.txt "$out/control_$tool.txt"
    include=${RP_GPU_SANITIZE_INCLUDE:-}
    [ "$tool" = racecheck ] && include=${include:-"regex=rp::kernels|2rp7kernels"}
    filters=(${RP_GPU_SANITIZE_EXCLUDE:+--kernel-name-exclude "$RP_GPU_SANITIZE_EXCLUDE"}
      ${include:+--kernel-name "$include"})
    # memcheck's default (extended) also counts the driver's log messages as errors; cuDNN's
    # precompiled engines load modules whose kernel names repeat ("Duplicate entry kernels named
    # cutlass__5x_cudnn..." in a convolution backward), which it handles itself. explicit still
    # reports every CUDA API call that returns an error. RP_GPU_SANITIZE_API_ERRORS=extended
    # (or all) brings them back.
    [ "$tool" = memcheck ] && filters+=(--report-api-errors "${RP_GPU_SANITIZE_API_ERRORS:-explicit}")
    # The known-bad control first: the tool must report it (its exit code 1).
    case $tool in racecheck) fault=race ;; *) fault=oob ;; esac
    "$cs" --tool "$tool" --error-exitcode 1 "${filters[@]}" --log-file "$out/control_$tool.txt" \
      "$build/tests/gpu/sanitizer_control" "$fault" > /dev/null 2>&1
    control_rc=$?
    if [ "$control_rc" = 1 ]; then control="control reported"; else
      control="CONTROL NOT REPORTED (exit $control_rc, see control_$tool.txt)"; status=failed; fi
    echo "sanitizer_$tool control ($fault): $control"
    step "sanitizer_$tool" env -u RP_TRACE_OUT RP_TEST_UNDER_SANITIZER=1 timeout --kill-after=30 "${RP_GPU_SANITIZE_TIMEOUT:-1800}" \
      "$cs" --tool "$tool" --target-processes all --error-exitcode 1 --print-limit 200 \
      "${filters[@]}" --log-file "$out/sanitizer_$tool.%p.txt" \
      ctest --test-dir "$build" -L gpu ${RP_GPU_SANITIZE_TESTS:+-R "$RP_GPU_SANITIZE_TESTS"} --output-on-failure
    # memcheck ends with "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: H hazards
    # displayed (N errors, W warnings)"; an internal sanitizer error counts as one of the latter.
    errors=$(cat "$out/sanitizer_$tool".*.txt 2>/dev/null |
      sed -n -e 's/.*ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' \
        -e 's/.*RACECHECK SUMMARY: .*(\([0-9][0-9]*\) error.*/\1/p' | awk '{n += $1} END {print n + 0}')
    tests=$(grep -E "tests passed|tests failed" "$out/sanitizer_$tool.log" | tail -1)
    sanitizer_line="${sanitizer_line:+$sanitizer_line, }$tool $errors errors (${tests:-no ctest summary}; $control)"
    [ "$errors" = 0 ] || status=failed
  done
fi

gpu_line=$(grep -E "tests passed|tests failed" "$out/gpu_tests.log" 2>/dev/null | tail -1)
cpu_line=$(grep -E "tests passed|tests failed" "$out/cpu_tests.log" 2>/dev/null | tail -1)
echo "SUMMARY: $status; gpu: ${gpu_line:-none}; cpu: ${cpu_line:-none}; compute-sanitizer: $sanitizer_line; device: $(head -1 "$out/gpu.txt")"
[ "$status" = ok ]
