# shellcheck shell=bash
# Shared by scripts/setup.sh and scripts/test.sh (sourced, not run): where the tree and the build
# are, which Python and which CUDA toolkit to use, how to configure and build.
#
# Knobs (environment):
#   RP_BUILD_DIR   build folder (default: <repo>/build)
#   RP_JOBS        parallel compile jobs (default: 2)
#   RP_BUILD_LOCK  lock file taken around configure and build (default: /tmp/rp-build.lock)
#   RP_CMAKE_ARGS  extra arguments for the CMake configure step (split on spaces)
#   PYTHON         interpreter to start from (default: python3)
#   CUDA_HOME      a CUDA toolkit to use (default: looked for, else assembled from PyPI wheels)

RP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RP_BUILD_DIR=${RP_BUILD_DIR:-$RP_ROOT/build}
RP_JOBS=${RP_JOBS:-2}
RP_BUILD_LOCK=${RP_BUILD_LOCK:-/tmp/rp-build.lock}
RP_TORCH_VERSION=2.11.0
RP_VENV=$RP_ROOT/.venv
RP_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/roundpipe

rp_log() { printf '[roundpipe] %s\n' "$*" >&2; }
rp_die() {
    rp_log "error: $*"
    exit 1
}

# Run "$@" holding the build lock, so concurrent builds in one tree never interleave.
rp_locked() {
    if command -v flock >/dev/null 2>&1; then
        flock "$RP_BUILD_LOCK" "$@"
    else
        "$@"
    fi
}

# Cargo installed by rustup lives in ~/.cargo/bin, which non-login shells may not have on PATH.
rp_cargo_path() {
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
}

# Choose the Python that gets torch, pytest and numpy, and export it as RP_PYTHON (first on PATH).
# $1: "create" (setup.sh) or "use" (test.sh).
#   - <repo>/.venv when it exists;
#   - else $PYTHON / python3 when pip may install into it (pyenv, conda, an active venv, ...);
#   - else (an "externally managed" system Python, PEP 668, such as Debian's) a new <repo>/.venv,
#     but only when called with "create" (setup.sh); test.sh never creates one.
rp_select_python() {
    local mode=${1:-}
    if [ ! -x "$RP_VENV/bin/python" ]; then
        local py=${PYTHON:-python3}
        command -v "$py" >/dev/null 2>&1 || rp_die "$py not found (run scripts/setup.sh first)"
        if "$py" - <<'EOF'; then
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if not in_venv and os.path.exists(marker) else 1)
EOF
            if [ "$mode" != create ]; then
                rp_die "$py is externally managed and $RP_VENV does not exist: run scripts/setup.sh"
            fi
            rp_log "$(command -v "$py") is externally managed (PEP 668): creating $RP_VENV"
            "$py" -m venv "$RP_VENV" || rp_die "could not create $RP_VENV (apt install python3-venv)"
        else
            RP_PYTHON=$(command -v "$py")
            export RP_PYTHON
            return 0
        fi
    fi
    export VIRTUAL_ENV=$RP_VENV
    export PATH="$RP_VENV/bin:$PATH"
    RP_PYTHON=$RP_VENV/bin/python
    export RP_PYTHON
}

# Succeeds when torch==RP_TORCH_VERSION (any local build tag), pytest and numpy are installed.
rp_python_deps_ok() {
    "$RP_PYTHON" - "$RP_TORCH_VERSION" <<'EOF'
import importlib.metadata as md, sys
try:
    ok = md.version("torch").split("+")[0] == sys.argv[1]
    md.version("pytest")
    md.version("numpy")
except md.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
EOF
}

# Sets RP_TORCH_PREFIX (CMake prefix path) and RP_TORCH_CUDA (e.g. "13.0"; empty for a CPU build).
rp_torch_info() {
    local info
    info=$("$RP_PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path); print(torch.version.cuda or "")') ||
        rp_die "cannot import torch with $RP_PYTHON (run scripts/setup.sh)"
    RP_TORCH_PREFIX=$(printf '%s\n' "$info" | sed -n 1p)
    RP_TORCH_CUDA=$(printf '%s\n' "$info" | sed -n 2p)
}

rp_nvcc_release() { "$1" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p'; }

# Find a CUDA toolkit (nvcc, headers, libraries) for torch's CUDA build: the libtorch CMake
# package needs one to configure, even on machines without a GPU. Prefers one whose major version
# matches torch's. Sets RP_CUDA_HOME; fails when there is none.
rp_find_cuda() {
    local want=$RP_TORCH_CUDA nvcc_dir="" cand release pass
    if command -v nvcc >/dev/null 2>&1; then
        nvcc_dir=$(dirname "$(dirname "$(command -v nvcc)")")
    fi
    for pass in major any; do
        for cand in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "$nvcc_dir" "/usr/local/cuda-$want" \
            /usr/local/cuda "$RP_CACHE/cuda-$want"; do
            if [ -z "$cand" ] || [ ! -x "$cand/bin/nvcc" ]; then
                continue
            fi
            release=$(rp_nvcc_release "$cand/bin/nvcc")
            if [ "$pass" = major ] && [ "${release%%.*}" != "${want%%.*}" ]; then
                continue
            fi
            [ "$pass" = any ] && rp_log "warning: using CUDA $release at $cand; torch was built with CUDA $want"
            RP_CUDA_HOME=$cand
            return 0
        done
    done
    return 1
}

# Assemble a CUDA toolkit from NVIDIA's PyPI wheels at $RP_CACHE/cuda-<version>: the compiler
# wheels matching the cuda-toolkit release torch depends on, plus symbolic links to the CUDA
# libraries and headers that came with torch. Used only when no toolkit is installed.
rp_assemble_cuda() {
    local want=$RP_TORCH_CUDA major=${RP_TORCH_CUDA%%.*} ctk dest tmp site root dir f
    dest=$RP_CACHE/cuda-$want
    ctk=$("$RP_PYTHON" - <<'EOF'
import importlib.metadata as md, re
for req in md.requires("torch") or []:
    m = re.match(r"cuda-toolkit\[[^\]]*\]\s*==\s*([0-9][0-9.]*)", req)
    if m:
        print(m.group(1))
        break
EOF
    )
    [ -n "$ctk" ] || rp_die "no CUDA toolkit found and torch names no cuda-toolkit wheel: install CUDA $want and set CUDA_HOME"
    rp_log "no CUDA $want toolkit found: assembling one from PyPI (cuda-toolkit==$ctk) at $dest"
    tmp=$(mktemp -d "$RP_CACHE.tmp.XXXXXX")
    "$RP_PYTHON" -m pip install --quiet --disable-pip-version-check --target "$tmp" \
        "cuda-toolkit[nvcc,cccl,crt,nvvm,culibos,cudart]==$ctk" || rp_die "pip could not install the CUDA compiler wheels"
    root=$tmp/nvidia/cu$major
    [ -x "$root/bin/nvcc" ] || rp_die "the cuda-toolkit wheels hold no bin/nvcc under nvidia/cu$major"
    site=$("$RP_PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    for dir in "$site/nvidia/cu$major" "$site/nvidia/cudnn"; do
        for sub in include lib; do
            [ -d "$dir/$sub" ] || continue
            for f in "$dir/$sub"/*; do
                [ -e "$root/$sub/$(basename "$f")" ] || ln -s "$f" "$root/$sub/"
            done
        done
    done
    # Wheels hold no symbolic links: add the unversioned names that linkers and CMake look for,
    # the lib64 alias, and a driver stub (libcuda.so is the driver's, never in a wheel) that only
    # satisfies CMake's CUDA::cuda_driver target; at run time the real driver, if any, is used.
    (cd "$root/lib" && for f in lib*.so.*; do
        [ -e "${f%%.so.*}.so" ] || ln -s "$f" "${f%%.so.*}.so"
    done)
    [ -e "$root/lib64" ] || ln -s lib "$root/lib64"
    mkdir -p "$root/lib/stubs"
    printf 'void cuGetErrorString(void) {}\n' |
        cc -shared -fPIC -x c - -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so"
    rm -rf "$dest"
    mkdir -p "$(dirname "$dest")"
    mv "$root" "$dest"
    rm -rf "$tmp"
    [ "$(rp_nvcc_release "$dest/bin/nvcc")" = "$want" ] || rp_die "assembled toolkit at $dest does not run"
}

# Export the CUDA toolkit (if torch is a CUDA build) to CMake: CUDA_HOME, CUDACXX and PATH.
# $1: "assemble" (setup.sh: build one from PyPI when none is found) or "find" (test.sh).
rp_cuda_env() {
    [ -n "$RP_TORCH_CUDA" ] || return 0
    if ! rp_find_cuda; then
        [ "${1:-}" = assemble ] || rp_die "no CUDA toolkit for torch's CUDA $RP_TORCH_CUDA (run scripts/setup.sh)"
        rp_assemble_cuda
        rp_find_cuda || rp_die "no usable CUDA toolkit"
    fi
    export CUDA_HOME=$RP_CUDA_HOME CUDA_PATH=$RP_CUDA_HOME CUDACXX=$RP_CUDA_HOME/bin/nvcc
    export PATH="$RP_CUDA_HOME/bin:$PATH"
}

# Configure the build folder (Ninja, Release). A folder configured before keeps its generator and
# cache; re-running cmake on it is cheap.
rp_configure() {
    # The tests find python3 and cargo on PATH, which rp_select_python and rp_cargo_path set.
    # Tests and examples are always on: test.sh runs them and setup.sh runs an example.
    local args=(-S "$RP_ROOT" -B "$RP_BUILD_DIR" "-DCMAKE_PREFIX_PATH=$RP_TORCH_PREFIX"
        -DRP_BUILD_TESTS=ON -DRP_BUILD_EXAMPLES=ON)
    if [ ! -f "$RP_BUILD_DIR/CMakeCache.txt" ]; then
        args+=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
    fi
    # Extra arguments, e.g. RP_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Debug".
    local extra=()
    read -r -a extra <<<"${RP_CMAKE_ARGS:-}"
    args+=("${extra[@]}")
    rp_log "configuring $RP_BUILD_DIR"
    rp_locked cmake "${args[@]}"
}

rp_build() {
    rp_log "building $RP_BUILD_DIR with $RP_JOBS jobs"
    rp_locked cmake --build "$RP_BUILD_DIR" -j "$RP_JOBS"
}
