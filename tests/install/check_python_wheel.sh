#!/usr/bin/env bash
# ctest install_python_wheel: in a fresh virtualenv that sees the torch already installed
# (--system-site-packages), `pip wheel --no-deps ./bindings/python` builds a platform wheel that
# carries libroundpipe.so and requires exactly this torch; pip installs that wheel; then, from a folder outside the repository and with no ROUNDPIPE_LIBRARY, a
# script imports roundpipe, finds the library inside the package and trains a small model; and
# the load check refuses a library built against another torch.
#   check_python_wheel.sh <python> <scratch folder>
# pip builds the library with CMake once (minutes on 2 cores), for the wheel. `pip install
# ./bindings/python`, the README's command, is that same build followed by the install of its
# wheel, so installing the wheel file checks the install without building the library a second
# time (which took as long again: each pip build starts a fresh build folder). pip needs PyPI for
# scikit-build-core (kept in pip's cache).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
python=$1 work=$2
export CMAKE_BUILD_PARALLEL_LEVEL=${RP_JOBS:-2}
rm -rf "$work"
mkdir -p "$work"

say "fresh virtualenv $work/venv (--system-site-packages, for torch)"
"$python" -m venv --system-site-packages "$work/venv"
venv_python=$work/venv/bin/python
# When <python> is itself a virtualenv's (scripts/setup.sh's .venv, beside an externally managed
# system Python), torch is in its site-packages, which --system-site-packages does not reach.
"$python" - "$venv_python" <<'PY'
import subprocess, sys, sysconfig
if sys.prefix != sys.base_prefix:
    site = subprocess.check_output([sys.argv[1], "-c", "import sysconfig; "
                                    "print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    with open(site + "/parent-environment.pth", "w") as pth:
        pth.write("\n".join(paths) + "\n")
PY
pip=("$venv_python" -m pip --disable-pip-version-check --no-input)
torch=$("$venv_python" -c 'import importlib.metadata as m; print(m.version("torch"))')

say "pip wheel --no-deps ./bindings/python"
"${pip[@]}" wheel --no-deps -w "$work/dist" "$RP_REPO/bindings/python"
"$venv_python" - "$work/dist" "$torch" <<'PY'
import glob, sys, zipfile
dist, torch = sys.argv[1:]
wheels = glob.glob(dist + "/roundpipe-*.whl")
assert len(wheels) == 1, wheels
name = wheels[0].rsplit("/", 1)[1]
assert name.endswith("-py3-none-linux_x86_64.whl"), "not a py3 platform wheel: " + name
with zipfile.ZipFile(wheels[0]) as whl:
    names = whl.namelist()
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [l for l in whl.read(meta).decode().splitlines()
                if l.startswith("Requires-Dist:") and "extra ==" not in l]
assert "roundpipe/libroundpipe.so" in names, names
assert "roundpipe/_capi.py" in names, names
assert requires == ["Requires-Dist: torch==" + torch], requires
print("%s: roundpipe/libroundpipe.so, %s" % (name, requires[0]))
PY

say "pip install the wheel"
"${pip[@]}" install "$work"/dist/roundpipe-*.whl

run=$(mktemp -d /tmp/rp-python-wheel.XXXXXX)
trap 'rm -rf "$run"' EXIT
say "import roundpipe and train, from $run"
cd "$run"
"$venv_python" - "$work/venv" <<'PY'
import os, sys
import torch
import roundpipe

venv = os.path.realpath(sys.argv[1])
library = os.path.realpath(roundpipe.library_path())
package = os.path.dirname(os.path.realpath(roundpipe.__file__))
assert library == os.path.join(package, "libroundpipe.so"), library
assert library.startswith(venv + os.sep), "the library is not the installed wheel's: " + library
print("library", library, "built against torch", roundpipe._capi.lib().rp_torch_version().decode())

# y = x . w + 1 on 64 samples; a linear layer trained with the engine's AdamW must fit it.
generator = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=generator)
y = x @ torch.randn(8, 1, generator=generator) + 1
model = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(8, 1)), devices="cpu", seed=0,
                            model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=2))
adamw = roundpipe.optim.AdamW(lr=0.05)
losses = []
for _ in range(150):
    losses.append(float(model.forward_backward(
        input_args=(x,), label=y,
        loss_fn=lambda out, label: torch.nn.functional.mse_loss(out, label) / 2)))
    model.step(adamw)
model.synchronize()
print("loss %.4g -> %.4g" % (losses[0], losses[-1]))
assert losses[-1] < losses[0] / 100, losses
model.close()

# The load check refuses a library built against another torch, naming both versions.
class OtherTorchLibrary:
    def rp_torch_version(self):
        return b"1.0.0"
try:
    roundpipe._capi._check_torch_version(OtherTorchLibrary(), "libroundpipe.so")
    raise AssertionError("a library built against torch 1.0.0 was accepted")
except roundpipe.LibraryNotFoundError as exc:
    assert "built against torch 1.0.0" in str(exc) and torch.__version__ in str(exc), exc
    print("refused:", exc)
PY
say "passed"
