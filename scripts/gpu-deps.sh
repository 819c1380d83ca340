#!/usr/bin/env bash
# Gathers the build-only dependencies that the GPU machines lack (nlohmann-json headers, CMocka)
# into .gpu-deps/, an ignored folder the device call carries along. Run on a machine where the
# README's set-up has installed them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps=$root/.gpu-deps
rm -rf "$deps"
mkdir -p "$deps/include" "$deps/share/cmake" "$deps/lib"
cp -r /usr/include/nlohmann "$deps/include/"
cp -r /usr/share/cmake/nlohmann_json "$deps/share/cmake/"
cp /usr/include/cmocka.h /usr/include/cmocka_pbc.h "$deps/include/"
cp -P /usr/lib/x86_64-linux-gnu/libcmocka.so* "$deps/lib/"
du -sh "$deps"
