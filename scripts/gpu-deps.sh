#!/usr/bin/env bash
# Gathers the build-only dependencies that the GPU machines lack (nlohmann-json headers, CMocka,
# gloo headers for data parallelism, PEFT for the LoRA check) into .gpu-deps/, and NVIDIA's
# compute-sanitizer wheel ($RP_SANITIZER_VERSION, default 13.5.25: newer than the machines'
# CUDA 13.0 one) into .compute-sanitizer/, ignored folders a device call carries along
# (carry [".gpu-deps", ".compute-sanitizer"]; scripts/gpu-check.sh unpacks the wheel). Run on a
# machine where the README's set-up has installed them and PyPI is reachable.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps=$root/.gpu-deps
rm -rf "$deps"
mkdir -p "$deps/include" "$deps/share/cmake" "$deps/lib"
cp -r /usr/include/nlohmann "$deps/include/"
cp -r /usr/share/cmake/nlohmann_json "$deps/share/cmake/"
cp /usr/include/cmocka.h /usr/include/cmocka_pbc.h "$deps/include/"
cp -P /usr/lib/x86_64-linux-gnu/libcmocka.so* "$deps/lib/"
[ -d /usr/include/gloo ] && cp -r /usr/include/gloo "$deps/include/"
python3 -m pip install -q --no-deps --target "$deps/python" peft accelerate ||
  echo "gpu-deps: peft not fetched (the LoRA check on the GPU is then skipped)"
sanitizer=$root/.compute-sanitizer
mkdir -p "$sanitizer"
python3 -m pip download -q --no-deps -d "$sanitizer" \
  "nvidia-cuda-sanitizer-api==${RP_SANITIZER_VERSION:-13.5.25}" ||
  echo "gpu-deps: sanitizer wheel not fetched (gpu-check.sh uses the machine's)"
du -sh "$deps" "$sanitizer"
