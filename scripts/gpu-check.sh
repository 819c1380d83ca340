#!/usr/bin/env bash
# The whole GPU check, in one command for a lent GPU machine: configure against PyTorch's
# libtorch, build with CUDA, run the gpu-labelled tests, the CPU suite with a GPU visible, and
# the C example on the GPU. Logs go to $OUT (or /tmp/rp-gpu-check); the last line is a summary.
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
# Rust needs cargo and the ABI gate needs SWIG, which the GPU machines lack; CI runs both.
step cpu_tests ctest --test-dir "$build" -L cpu -E '^(rust|abi_gate)$' -j8 --output-on-failure
step example_gpu "$build/examples/c/train_mlp" --device auto
gpu_line=$(grep -E "tests passed|tests failed" "$out/gpu_tests.log" | tail -1)
cpu_line=$(grep -E "tests passed|tests failed" "$out/cpu_tests.log" | tail -1)
echo "SUMMARY: $status; gpu: ${gpu_line:-none}; cpu: ${cpu_line:-none}; device: $(head -1 "$out/gpu.txt")"
[ "$status" = ok ]
