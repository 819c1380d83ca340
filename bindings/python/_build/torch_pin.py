"""scikit-build-core metadata provider: the wheel's torch requirement, ``torch==<version>``.

libroundpipe.so links libtorch's C++ API, which changes between torch releases, so the wheel
runs only with the torch it was built against. That is the torch of the environment pip installs
into: pip runs this build with that environment's interpreter (``sys.executable``) but hides its
site-packages from the build (through PYTHONPATH); ``-E`` (ignore PYTHON* variables) shows them
again. cmake/python_wheel.cmake finds the same torch for the CMake build the same way.

Declared in pyproject.toml as ``[tool.scikit-build.metadata.dependencies]`` with
``provider-path = "_build"`` (a provider outside scikit-build-core needs ``experimental``).
"""

import subprocess
import sys

_QUERY = "import importlib.metadata as m; print(m.version('torch'))"


def dynamic_metadata(field, settings=None):
    if field != "dependencies":
        raise RuntimeError("torch_pin provides 'dependencies' only, not %r" % field)
    if settings:
        raise RuntimeError("torch_pin takes no settings, got %s" % sorted(settings))
    run = subprocess.run([sys.executable, "-E", "-c", _QUERY], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True)
    if run.returncode != 0:
        raise RuntimeError(
            "RoundPipe's wheel is built against the torch of the environment it is installed "
            "into, and %s has no torch: install torch first (pip install torch), then RoundPipe."
            "\n%s" % (sys.executable, run.stderr.strip()))
    # The exact distribution version ("2.11.0", or "2.11.0+cpu" from PyTorch's own index).
    return ["torch==%s" % run.stdout.strip()]
