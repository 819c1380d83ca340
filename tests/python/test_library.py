"""Finding and loading libroundpipe: search order, ABI check, errors that list every path."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import _capi  # noqa: E402

PACKAGE_DIR = os.path.dirname(os.path.abspath(roundpipe.__file__))


def test_loaded_library_has_our_abi_and_a_version():
    assert roundpipe.ABI_VERSION == 1
    assert _capi.lib().rp_abi_version() == 1
    major, minor, patch = roundpipe.library_version().split(".")
    assert major.isdigit() and minor.isdigit() and patch.isdigit()
    assert os.path.exists(roundpipe.library_path())
    assert roundpipe.cuda_device_count() >= 0


def test_search_order(monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_LIBRARY", "/somewhere/libroundpipe.so")
    paths = [p for _, p in roundpipe.candidate_paths()]
    origins = [o for o, _ in roundpipe.candidate_paths()]
    assert paths[0] == "/somewhere/libroundpipe.so"
    assert paths[1] == os.path.join(PACKAGE_DIR, "libroundpipe.so")
    first_build = origins.index("build tree")
    assert origins[1:first_build] == ["next to the package"] * (first_build - 1)
    repo = os.path.normpath(os.path.join(PACKAGE_DIR, "..", "..", ".."))
    assert paths[first_build] == os.path.join(repo, "build", "libroundpipe.so")


def test_status_strings_come_from_the_library():
    assert roundpipe._capi.status_string(roundpipe.Status.INVALID_ARGUMENT)
    err = roundpipe.RoundPipeError(-1, "boom")
    assert err.status is roundpipe.Status.INVALID_ARGUMENT and str(err).endswith("boom")


def run_isolated(tmp_path, env_library, code):
    """Run `code` with a copy of the package outside the checkout (no build tree near it)."""
    pkg = tmp_path / "site"
    shutil.copytree(PACKAGE_DIR, pkg / "roundpipe",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so*"))
    env = dict(os.environ, PYTHONPATH=str(pkg))
    env.pop("ROUNDPIPE_LIBRARY", None)
    if env_library is not None:
        env["ROUNDPIPE_LIBRARY"] = env_library
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))


def test_missing_library_error_lists_every_path_tried(tmp_path):
    missing = str(tmp_path / "nowhere" / "libroundpipe.so")
    result = run_isolated(tmp_path, missing, """
        import roundpipe
        try:
            roundpipe.load_library()
        except roundpipe.LibraryNotFoundError as e:
            assert isinstance(e, roundpipe.RoundPipeError) and isinstance(e, OSError)
            print(e)
        else:
            print("LOADED", roundpipe.library_path())
    """)
    assert result.returncode == 0, result.stderr
    if "LOADED" in result.stdout:
        pytest.skip("a libroundpipe is installed system-wide: %s" % result.stdout)
    assert missing in result.stdout
    assert os.path.join(str(tmp_path / "site" / "roundpipe"), "libroundpipe.so") in result.stdout
    assert "ROUNDPIPE_LIBRARY" in result.stdout


def test_environment_variable_wins(tmp_path):
    result = run_isolated(tmp_path, roundpipe.library_path(), """
        import roundpipe
        print(roundpipe.library_path())
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == roundpipe.library_path()


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_wrong_abi_version_is_refused(tmp_path):
    src = tmp_path / "fake.c"
    src.write_text("int rp_abi_version(void) { return 2; }\n"
                   "int rp_model_create(void) { return 0; }\n")
    lib = tmp_path / "libroundpipe.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    result = run_isolated(tmp_path, str(lib), """
        import roundpipe
        try:
            roundpipe.load_library()
        except roundpipe.RoundPipeError as e:
            print(e)
    """)
    assert result.returncode == 0, result.stderr
    assert "ABI version 2" in result.stdout and "needs 1" in result.stdout
