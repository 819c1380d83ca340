#!/usr/bin/env bash
# ctest install_c_programs: `cmake --install` into a fresh prefix, which is then moved (the
# installed tree must not depend on where it was installed), then a C program built with the
# README's pkg-config line and the same program built by a CMake project with
# find_package(roundpipe) both build and run with the loader cache ignored and no
# LD_LIBRARY_PATH: the library's run path must find libtorch and the torch wheel's CUDA runtime.
#   check_c_install.sh <build folder> <torch version> <scratch folder>
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
build=$1 torch=$2 work=$3
rm -rf "$work"
mkdir -p "$work"

say "installing $build into a fresh prefix"
cmake --install "$build" --prefix "$work/installed-here" >/dev/null
mv "$work/installed-here" "$work/prefix"
prefix=$work/prefix
pc=$(find "$prefix" -name roundpipe.pc)
[ -n "$pc" ] || fail "no roundpipe.pc under $prefix"

say "pkg-config: cc app.c \$(pkg-config --cflags --libs roundpipe)"
flags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags --libs roundpipe)
cc -std=c99 -Wall -Wextra -Werror "-DRP_EXPECTED_TORCH=\"$torch\"" \
    "$RP_REPO/tests/install/consumer/app.c" $flags -o "$work/app_pkg_config"
run_without_loader_cache "$work/app_pkg_config"

say "CMake: find_package(roundpipe)"
cmake -S "$RP_REPO/tests/install/consumer" -B "$work/consumer-build" -G Ninja \
    "-DCMAKE_PREFIX_PATH=$prefix" "-DRP_EXPECTED_TORCH=$torch" >/dev/null
cmake --build "$work/consumer-build" >/dev/null
run_without_loader_cache "$work/consumer-build/app"

rm -rf "$work"
say "passed"
