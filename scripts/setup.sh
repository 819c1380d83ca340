#!/usr/bin/env bash
# Set up RoundPipe on a Debian 12 machine: system packages, Python packages (torch, pytest, numpy,
# tqdm, matplotlib), configure and build (Ninja, Release), then run the first-run C example
# (a small language model learning English for about a minute; its output goes to
# <build>/first_run).
# Idempotent: on a machine that has everything, it only re-runs CMake, the (incremental) build
# and the example. Run as root, or as a user with sudo for the apt step.
#
#   bash scripts/setup.sh
#
# Python: the packages go into `python3` (pyenv, conda, an active virtualenv, ...) unless that
# interpreter is "externally managed" (PEP 668, e.g. Debian's /usr/bin/python3); then into a
# virtualenv at <repo>/.venv, which scripts/test.sh picks up by itself. No
# --break-system-packages, ever. pip keeps the ~3 GB torch download in its cache (~/.cache/pip).
#
# CUDA: torch's CUDA build needs a CUDA toolkit at configure time, also on machines without a GPU.
# An installed one is used ($CUDA_HOME, nvcc on PATH, /usr/local/cuda); if there is none, one is
# assembled from NVIDIA's PyPI wheels under ~/.cache/roundpipe (see scripts/common.sh).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$RP_ROOT"
export PIP_ROOT_USER_ACTION=ignore

rp_phase_start=$SECONDS
rp_phase() {
    rp_log "$1 done in $((SECONDS - rp_phase_start)) s"
    rp_phase_start=$SECONDS
}

# 1. Debian packages (only the missing ones; apt-get update only when something is missing).
install_system_packages() {
    # clang, its sanitizer and libFuzzer runtimes, LLVM's OpenMP and llvm-symbolizer: the
    # sanitizer build of scripts/sanitize.sh (which scripts/test.sh runs).
    local packages=(build-essential cmake ninja-build pkg-config libcmocka-dev nlohmann-json3-dev
        libgloo-dev swig python3 python3-pip python3-venv ca-certificates
        clang libclang-rt-14-dev libomp-dev llvm)
    rp_cargo_path
    if ! command -v cargo >/dev/null 2>&1; then
        packages+=(cargo rustc) # Debian's Rust; a rustup install on PATH is used as it is
    fi
    if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
        rp_log "warning: not a Debian system; make sure these (or equivalents) are installed: ${packages[*]}"
        return 0
    fi
    local missing=() p
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' ||
            missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || rp_die "need root (or sudo) to install: ${missing[*]}"
        sudo=(sudo)
    fi
    rp_log "installing Debian packages: ${missing[*]}"
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}"
}

# 2. Python packages. tqdm draws the binding's progress bars; matplotlib the examples' loss plots
# and bench/plot_trace.py; transformers the Python tests against Hugging Face models, peft the
# LoRA tests (they skip without them).
rp_python_extras_ok() {
    "$RP_PYTHON" -c 'import importlib.metadata as md; md.version("tqdm"); md.version("matplotlib")' \
        >/dev/null 2>&1
}
install_python_packages() {
    rp_select_python create
    if rp_python_deps_ok && rp_python_extras_ok; then
        rp_log "torch $RP_TORCH_VERSION, pytest, numpy, tqdm and matplotlib already installed for $RP_PYTHON"
        return 0
    fi
    rp_log "installing torch==$RP_TORCH_VERSION, pytest, numpy, tqdm and matplotlib for $RP_PYTHON"
    "$RP_PYTHON" -m pip install --disable-pip-version-check --progress-bar off \
        "torch==$RP_TORCH_VERSION" pytest numpy tqdm matplotlib transformers peft
    rp_python_deps_ok && rp_python_extras_ok ||
        rp_die "torch $RP_TORCH_VERSION, pytest, numpy, tqdm or matplotlib still missing after pip"
}

install_system_packages
rp_phase "system packages"
install_python_packages
rp_phase "python packages"
rp_cargo_path
rp_torch_info
rp_cuda_env assemble
if [ -n "$RP_TORCH_CUDA" ]; then
    rp_log "CUDA toolkit: $CUDA_HOME (torch built with CUDA $RP_TORCH_CUDA)"
fi
rp_configure
rp_phase "configure"
rp_build
rp_phase "build"

example=$RP_BUILD_DIR/examples/c/train_tiny_lm
[ -x "$example" ] || rp_die "$example was not built (is RP_BUILD_EXAMPLES off in $RP_BUILD_DIR?)"
rp_log "running $example"
PYTHON="$RP_PYTHON" "$example" --out "$RP_BUILD_DIR/first_run"
rp_phase "example"
rp_log "set-up complete; run the tests with: bash scripts/test.sh"
