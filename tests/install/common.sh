# shellcheck shell=bash
# Shared by the tests of tests/install (sourced). Each runs as a user would, in a fresh folder,
# with none of the variables that could find the library for it.
set -euo pipefail
unset LD_LIBRARY_PATH LD_PRELOAD ROUNDPIPE_LIBRARY ROUNDPIPE_LIB_DIR PYTHONPATH PKG_CONFIG_PATH
RP_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

say() { printf '[%s] %s\n' "$(basename "$0" .sh)" "$*"; }
fail() {
    say "FAILED: $*" >&2
    exit 1
}

# The dynamic loader a program asks for (its PT_INTERP, e.g. /lib64/ld-linux-x86-64.so.2).
program_interpreter() {
    local interp
    interp=$(readelf -l "$1" | sed -n 's/.*Requesting program interpreter: \(.*\)]$/\1/p')
    [ -x "$interp" ] || fail "no program interpreter found in $1"
    printf '%s\n' "$interp"
}

# Run a program with the dynamic loader's cache (/etc/ld.so.cache) ignored: only run paths and
# the loader's built-in folders (/lib/<arch>, /usr/lib/<arch>) can find its libraries then.
run_without_loader_cache() {
    "$(program_interpreter "$1")" --inhibit-cache "$@"
}
