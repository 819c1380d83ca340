#!/usr/bin/env bash
# ctest install_rust_path_dependency: a Rust program in a fresh folder outside the repository,
# whose Cargo.toml depends on `roundpipe` by path, builds and runs with `cargo run --offline`,
# and its binary then runs again with an empty environment and the loader cache ignored: the
# binary names the library found at build time by its absolute path (the link stub of
# roundpipe-sys/build.rs), so nothing has to find it at run time.
#   check_rust_path_dependency.sh <library folder> <scratch folder>
# ROUNDPIPE_LIB_DIR=<library folder> picks, at build time, the library of this build; when that
# is the repository's build/ (CI's), `cargo run` also runs with no variable at all.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
lib_dir=$(cd "$1" && pwd -P) work=$2
mkdir -p "$work"
export CARGO_TARGET_DIR=$work/target # kept between runs: only what changed is rebuilt
app=$(mktemp -d /tmp/rp-rust-app.XXXXXX)
trap 'rm -rf "$app"' EXIT
mkdir "$app/src"
cp "$RP_REPO/tests/install/rust_app.rs" "$app/src/main.rs"
cat >"$app/Cargo.toml" <<TOML
[package]
name = "roundpipe-user"
version = "0.1.0"
edition = "2021"

[dependencies]
roundpipe = { path = "$RP_REPO/bindings/rust/roundpipe" }
TOML
cd "$app"

say "cargo run --offline, in $app"
ROUNDPIPE_LIB_DIR=$lib_dir cargo run --offline --quiet
binary=$CARGO_TARGET_DIR/debug/roundpipe-user
needed=$(readelf -d "$binary" | sed -n 's/.*(NEEDED).*\[\(.*libroundpipe[^]]*\)\]/\1/p')
say "the binary needs $needed"
[ "$(dirname "$needed")" = "$lib_dir" ] || fail "the binary does not name $lib_dir/libroundpipe.so.*"

say "the binary, with an empty environment and no loader cache"
env -i "$(program_interpreter "$binary")" --inhibit-cache "$binary"

if [ "$lib_dir" = "$(cd "$RP_REPO" && pwd -P)/build" ]; then
    say "cargo run --offline with no variable (the library is the repository's build/)"
    env -i PATH="$PATH" HOME="$HOME" cargo run --offline --quiet
fi
say "passed"
