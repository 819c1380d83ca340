"""Tests of the header gate: it passes on the repository, and it catches deliberate breakage.

    python3 -m unittest discover -s tools/abi -p 'test_*.py'

Each binding is copied to a temporary folder, one declaration is broken (wrong arity, missing
function, extra function, wrong type...), and the gate must fail naming the binding, the function
and the difference. The header is broken the same way to show each convention is enforced.
Edits are made by locating the declaration (with `ast` for Python, by pattern for Rust and
Julia), so that they keep working when the bindings are reformatted.
"""

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import check_bindings  # noqa: E402

REPO = check_bindings.REPO
HEADER = os.path.join(REPO, "include", "roundpipe.h")
PATHS = {n: os.path.join(REPO, rel) for n, rel in check_bindings.BINDINGS.items()}
HAVE_SWIG = shutil.which(os.environ.get("SWIG", "swig")) is not None


def gate(header=HEADER, **paths):
    """Run the gate in-process on `paths` (binding -> file); returns (status, stderr text)."""
    out, err = io.StringIO(), io.StringIO()
    status = check_bindings.run(header, paths, out=out, err=err)
    return status, err.getvalue()


# --- Editing a copy of each binding ---------------------------------------------------------

def _py_decl(src, cname):
    """The ast.Call declaring `cname` in the Python binding, and its argument-type list."""
    for node in ast.walk(ast.parse(src)):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == cname and len(node.args) >= 3):
            lst = [a for a in node.args[1:3] if isinstance(a, (ast.List, ast.Tuple))][0]
            return node, lst
    raise AssertionError("no declaration of %s in the Python binding" % cname)


def _offset(src, line, col):
    lines = src.splitlines(keepends=True)
    return sum(len(x) for x in lines[:line - 1]) + col


def py_drop_last_param(src, cname):
    _, lst = _py_decl(src, cname)
    a, b = lst.elts[-2], lst.elts[-1]
    start = _offset(src, a.end_lineno, a.end_col_offset)
    end = _offset(src, b.end_lineno, b.end_col_offset)
    return src[:start] + src[end:]


def py_replace_param(src, cname, index, new):
    _, lst = _py_decl(src, cname)
    el = lst.elts[index]
    start = _offset(src, el.lineno, el.col_offset)
    end = _offset(src, el.end_lineno, el.end_col_offset)
    return src[:start] + new + src[end:]


def py_remove(src, cname):
    call, _ = _py_decl(src, cname)
    lines = src.splitlines(keepends=True)
    return "".join(lines[:call.lineno - 1] + lines[call.end_lineno:])


def py_add_extra(src, after, new_name):
    call, _ = _py_decl(src, after)
    lines = src.splitlines(keepends=True)
    block = "".join(lines[call.lineno - 1:call.end_lineno])
    block = block.replace('"%s"' % after, '"%s"' % new_name, 1)
    return "".join(lines[:call.end_lineno]) + block + "".join(lines[call.end_lineno:])


def rs_decl(src, cname):
    m = re.search(r"pub fn %s\s*\((.*?)\)\s*(->\s*[^;]+)?;" % re.escape(cname), src, re.S)
    assert m, "no declaration of %s in the Rust binding" % cname
    return m


def rs_drop_last_param(src, cname):
    m = rs_decl(src, cname)
    params = [p for p in re.split(r",(?![^<(]*[>)])", m.group(1)) if p.strip()]
    new = ", ".join(p.strip() for p in params[:-1])
    return src[:m.start(1)] + new + src[m.end(1):]


def rs_sub_in_decl(src, cname, old, new):
    m = rs_decl(src, cname)
    assert old in m.group(0), (old, m.group(0))
    return src[:m.start()] + m.group(0).replace(old, new, 1) + src[m.end():]


def rs_remove(src, cname):
    m = rs_decl(src, cname)
    return src[:m.start()] + src[m.end():]


def rs_add_extra(src, after, new_name):
    m = rs_decl(src, after)
    extra = m.group(0).replace("fn %s" % after, "fn %s" % new_name, 1)
    return src[:m.end()] + "\n    " + extra + src[m.end():]


def jl_ccall(src, cname):
    """(start, end) of the ccall of `cname` and of its type tuple, by bracket matching."""
    m = re.search(r"ccall\(\(:%s\b" % re.escape(cname), src)
    assert m, "no ccall of %s in the Julia binding" % cname
    i, depth, spans, top_commas = m.start() + len("ccall"), 0, None, []
    for j in range(i, len(src)):
        ch = src[j]
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return m.start(), j + 1, top_commas
        elif ch == "," and depth == 1:
            top_commas.append(j)
    raise AssertionError("unbalanced ccall")


def jl_drop_last_param(src, cname):
    start, end, commas = jl_ccall(src, cname)
    call = src[start:end]
    # Drop the last element of the type tuple (the third argument) and the last argument.
    t0, t1 = commas[1] - start + 1, commas[2] - start
    tup = call[t0:t1].strip()
    elems = [e.strip() for e in re.split(r",(?![^{]*\})", tup.strip()[1:-1]) if e.strip()]
    new_tup = "(" + ", ".join(elems[:-1]) + ("," if len(elems) - 1 == 1 else "") + ")"
    args = call[t1 + 1:-1]
    new_args = args.rsplit(",", 1)[0]
    new_call = call[:t0] + " " + new_tup + "," + new_args + ")"
    return src[:start] + new_call + src[end:]


def jl_remove(src, cname):
    start, end, _ = jl_ccall(src, cname)
    line_start = src.rfind("\n", 0, src.rfind("\n", 0, start)) + 1  # the `name(...) =` line
    line_end = src.find("\n", end)
    return src[:line_start] + src[line_end + 1:]


def jl_add_extra(src, after, new_name):
    start, end, _ = jl_ccall(src, after)
    line_end = src.find("\n", end)
    extra = "\n%s_extra_wrapper() = %s" % (new_name, src[start:end].replace(
        ":%s" % after, ":%s" % new_name, 1))
    return src[:line_end] + extra + src[line_end:]


EDITS = {
    "python": dict(drop=py_drop_last_param, remove=py_remove, extra=py_add_extra),
    "rust": dict(drop=rs_drop_last_param, remove=rs_remove, extra=rs_add_extra),
    "julia": dict(drop=jl_drop_last_param, remove=jl_remove, extra=jl_add_extra),
}


@unittest.skipUnless(HAVE_SWIG, "swig is not installed")
class GateOnRepository(unittest.TestCase):
    def test_header_and_every_binding_pass(self):
        status, err = gate(**PATHS)
        self.assertEqual(status, 0, err)

    def test_command_line_runs_from_any_folder(self):
        with tempfile.TemporaryDirectory() as cwd:
            proc = subprocess.run([sys.executable, os.path.join(HERE, "check_bindings.py")],
                                  cwd=cwd, capture_output=True, text=True)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("header gate: OK", proc.stdout)

    def test_missing_binding_file_fails(self):
        with tempfile.TemporaryDirectory() as tmp:
            status, err = gate(python=os.path.join(tmp, "_capi.py"))
        self.assertEqual(status, 1)
        self.assertIn("python: (binding): missing file", err)

    def test_missing_swig_is_reported(self):
        out, err = io.StringIO(), io.StringIO()
        status = check_bindings.run(HEADER, {}, swig="no-such-swig-binary", out=out, err=err)
        self.assertEqual(status, 2)
        self.assertIn("swig not found", err.getvalue())


class _BrokenCopy:
    """A copy of one binding in a temporary folder, edited by `edit(src) -> src`."""

    def __init__(self, binding, edit):
        self.binding = binding
        self.edit = edit

    def __enter__(self):
        self.tmp = tempfile.TemporaryDirectory()
        src_path = PATHS[self.binding]
        with open(src_path, encoding="utf-8") as f:
            src = f.read()
        new = self.edit(src)
        assert new != src, "the edit changed nothing"
        path = os.path.join(self.tmp.name, os.path.basename(src_path))
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        return path

    def __exit__(self, *exc):
        self.tmp.cleanup()


@unittest.skipUnless(HAVE_SWIG, "swig is not installed")
class GateCatchesBrokenBindings(unittest.TestCase):
    def check(self, binding, edit, *expected):
        if not os.path.exists(PATHS[binding]):
            self.skipTest("%s binding not written yet" % binding)
        with _BrokenCopy(binding, edit) as path:
            status, err = gate(**{binding: path})
        self.assertEqual(status, 1, "the gate passed a broken %s binding" % binding)
        for text in expected:
            self.assertIn(text, err)
        # The message names the copy that is broken.
        self.assertIn(os.path.basename(PATHS[binding]), err)

    # Wrong arity, missing function, extra function: for each binding.
    def _arity(self, binding):
        self.check(binding, lambda s: EDITS[binding]["drop"](s, "rp_step"),
                   "%s: rp_step: wrong arity: declares 2 parameters, the header has 3" % binding)

    def _missing(self, binding):
        self.check(binding, lambda s: EDITS[binding]["remove"](s, "rp_synchronize"),
                   "%s: rp_synchronize: missing: the header declares "
                   "`rp_status rp_synchronize(rp_model *model);`" % binding)

    def _extra(self, binding):
        self.check(binding, lambda s: EDITS[binding]["extra"](s, "rp_zero_grad", "rp_zero_grads"),
                   "%s: rp_zero_grads: extra function: not in the header" % binding)

    def test_python_wrong_arity(self):
        self._arity("python")

    def test_python_missing_function(self):
        self._missing("python")

    def test_python_extra_function(self):
        self._extra("python")

    def test_julia_wrong_arity(self):
        self._arity("julia")

    def test_julia_missing_function(self):
        self._missing("julia")

    def test_julia_extra_function(self):
        self._extra("julia")

    def test_rust_wrong_arity(self):
        self._arity("rust")

    def test_rust_missing_function(self):
        self._missing("rust")

    def test_rust_extra_function(self):
        self._extra("rust")

    # Types.
    def test_python_wrong_scalar_type(self):
        self.check("python", lambda s: py_replace_param(s, "rp_step", 2, "c_double"),
                   "python: rp_step: parameter 3 (is_async): binding has double, "
                   "the header has int32_t")

    def test_python_handle_of_the_wrong_kind(self):
        with open(PATHS["python"], encoding="utf-8") as f:
            if "class rp_model_p(" not in f.read():
                self.skipTest("the Python binding has no typed handle classes")
        self.check("python", lambda s: py_replace_param(s, "rp_loss_destroy", 0, "rp_model_p"),
                   "python: rp_loss_destroy: parameter 1 (loss): binding has rp_model *, "
                   "the header has rp_loss *")

    def test_rust_wrong_scalar_type(self):
        self.check("rust", lambda s: rs_sub_in_decl(s, "rp_model_options_set_seed", "seed: u64",
                                                    "seed: i64"),
                   "rust: rp_model_options_set_seed: parameter 2 (seed): binding has int64_t, "
                   "the header has uint64_t")

    def test_rust_constness(self):
        self.check("rust", lambda s: rs_sub_in_decl(s, "rp_step", "*const rp_optimizer",
                                                    "*mut rp_optimizer"),
                   "rust: rp_step: parameter 2 (optimizer)", "pointee constness differs")

    def test_rust_callback_signature(self):
        self.check("rust", lambda s: s.replace(
            "unsafe extern \"C\" fn(model: *mut rp_model, user_data: *mut c_void) -> i32",
            "unsafe extern \"C\" fn(model: *mut rp_model) -> i32"),
            "rust: rp_step_fn: callback type", "callback takes 1 parameters, header's takes 2")

    def test_rust_constant_value(self):
        self.check("rust", lambda s: re.sub(r"RP_ERR_IO: rp_status = -3;",
                                            "RP_ERR_IO: rp_status = -4;", s),
                   "rust: RP_ERR_IO: constant is -4, the header says -3")

    def test_rust_struct_layout(self):
        self.check("rust", lambda s: s.replace("    pub byte_offset: u64,\n", "", 1),
                   "rust: DLTensor: struct has 6 fields, the header's has 7")

    def test_julia_wrong_return_type(self):
        self.check("julia", lambda s: re.sub(r"(ccall\(\(:rp_abi_version, libroundpipe\(\)\)), Int32",
                                             r"\1, Int64", s),
                   "julia: rp_abi_version: return type: binding has int64_t, the header has int32_t")

    def test_julia_struct_field_type(self):
        self.check("julia", lambda s: s.replace("    ndim::Int32\n", "    ndim::Int64\n", 1),
                   "julia: DLTensor: field ndim: binding has int64_t")

    def test_julia_ccall_argument_count(self):
        def edit(s):
            start, end, _ = jl_ccall(s, "rp_zero_grad")
            call = s[start:end]
            return s[:start] + call[:-1] + ", model)" + s[end:]
        self.check("julia", edit, "julia: rp_zero_grad: ccall passes 2 arguments for 1 argument types")


# --- One source for the ABI version ----------------------------------------------------------

def header_abi_version(path=HEADER):
    with open(path, encoding="utf-8") as f:
        m = re.search(r"^#define RP_ABI_VERSION (\d+)$", f.read(), re.M)
    assert m, "the header has no '#define RP_ABI_VERSION <number>' line"
    return int(m.group(1))


# Each binding's ABI version constant, as it is spelled in its file.
ABI_CONSTANT_LINES = {
    "python": (r"^ABI_VERSION = (\d+)$", "ABI_VERSION = %d", "ABI_VERSION"),
    "julia": (r"^const RP_ABI_VERSION = (\d+)$", "const RP_ABI_VERSION = %d", "RP_ABI_VERSION"),
    "rust": (r"^pub const RP_ABI_VERSION: i32 = (\d+);$", "pub const RP_ABI_VERSION: i32 = %d;",
             "RP_ABI_VERSION"),
}


def set_abi_constant(binding, value):
    """An edit setting `binding`'s ABI version constant to `value`."""
    pattern, spelling, _ = ABI_CONSTANT_LINES[binding]

    def edit(src):
        new, n = re.subn(pattern, spelling % value, src, count=1, flags=re.M)
        assert n == 1, "no ABI version constant in the %s binding" % binding
        return new
    return edit


class AbiVersionCheckUnit(unittest.TestCase):
    """check_abi_version alone, on hand-made declarations (no swig needed)."""

    class FakeHeader:
        def __init__(self, version):
            self.constants = {"RP_ABI_VERSION": version}

        def define_line(self, name):
            return 837

    def binding(self, name, constant, value):
        from abigate.binding import Binding
        from abigate.abitypes import Policy
        b = Binding(name=name, path=name, policy=Policy(), abi_constant=constant)
        if value is not None:
            b.constants[constant] = (value, 34)
        return b

    def test_equal_values_pass(self):
        from abigate.binding import check_abi_version
        self.assertIsNone(check_abi_version(self.FakeHeader(3),
                                            self.binding("python", "ABI_VERSION", 3)))

    def test_a_wrong_value_fails_naming_both_values(self):
        from abigate.binding import check_abi_version
        subject, msg, line = check_abi_version(self.FakeHeader(3),
                                               self.binding("julia", "RP_ABI_VERSION", 2))
        self.assertEqual(subject, "RP_ABI_VERSION")
        self.assertEqual(line, 34)
        self.assertIn("ABI version is 2, the header's RP_ABI_VERSION is 3 "
                      "(include/roundpipe.h:837)", msg)
        self.assertIn("set RP_ABI_VERSION to 3", msg)

    def test_a_missing_constant_fails(self):
        from abigate.binding import check_abi_version
        subject, msg, _ = check_abi_version(self.FakeHeader(3),
                                            self.binding("python", "ABI_VERSION", None))
        self.assertEqual(subject, "ABI_VERSION")
        self.assertIn("missing ABI version constant: declare ABI_VERSION = 3", msg)


@unittest.skipUnless(HAVE_SWIG, "swig is not installed")
class GateChecksAbiVersion(unittest.TestCase):
    """Every binding's ABI version constant equals the header's RP_ABI_VERSION."""

    def wrong_value_fails(self, binding):
        if not os.path.exists(PATHS[binding]):
            self.skipTest("%s binding not written yet" % binding)
        want = header_abi_version()
        _, _, constant = ABI_CONSTANT_LINES[binding]
        with _BrokenCopy(binding, set_abi_constant(binding, want + 1)) as path:
            status, err = gate(**{binding: path})
        self.assertEqual(status, 1, "the gate passed a wrong %s ABI version" % binding)
        self.assertIn("%s: %s: ABI version is %d, the header's RP_ABI_VERSION is %d"
                      % (binding, constant, want + 1, want), err)
        self.assertIn(os.path.basename(PATHS[binding]), err)
        # Reported once, not also as an ordinary constant.
        self.assertNotIn("constant is %d" % (want + 1), err)

    def test_python_wrong_abi_version(self):
        self.wrong_value_fails("python")

    def test_julia_wrong_abi_version(self):
        self.wrong_value_fails("julia")

    def test_rust_wrong_abi_version(self):
        self.wrong_value_fails("rust")

    def test_python_missing_abi_version(self):
        def edit(src):
            new, n = re.subn(r"^ABI_VERSION = \d+$", "ABI_VERSION = library_abi_version()", src,
                             count=1, flags=re.M)
            assert n == 1
            return new
        with _BrokenCopy("python", edit) as path:
            status, err = gate(python=path)
        self.assertEqual(status, 1)
        self.assertIn("python: ABI_VERSION: missing ABI version constant: declare "
                      "ABI_VERSION = %d" % header_abi_version(), err)

    def test_header_bump_fails_every_binding_until_they_follow(self):
        want = header_abi_version() + 1
        with open(HEADER, encoding="utf-8") as f:
            src = f.read()
        new = re.sub(r"^#define RP_ABI_VERSION \d+$", "#define RP_ABI_VERSION %d" % want, src,
                     count=1, flags=re.M)
        with tempfile.TemporaryDirectory() as tmp:
            header = os.path.join(tmp, "roundpipe.h")
            with open(header, "w", encoding="utf-8") as f:
                f.write(new)
            status, err = gate(header=header, **PATHS)
            self.assertEqual(status, 1)
            for binding, (_, _, constant) in ABI_CONSTANT_LINES.items():
                self.assertIn("%s: %s: ABI version is %d, the header's RP_ABI_VERSION is %d"
                              % (binding, constant, want - 1, want), err)
            # Bindings that follow the header pass this check.
            copies = {}
            for binding in ABI_CONSTANT_LINES:
                with open(PATHS[binding], encoding="utf-8") as f:
                    text = set_abi_constant(binding, want)(f.read())
                copies[binding] = os.path.join(tmp, os.path.basename(PATHS[binding]))
                with open(copies[binding], "w", encoding="utf-8") as f:
                    f.write(text)
            status, err = gate(header=header, **copies)
            self.assertNotIn("ABI version", err)


# --- The header's conventions ---------------------------------------------------------------

@unittest.skipUnless(HAVE_SWIG, "swig is not installed")
class GateCatchesHeaderConventions(unittest.TestCase):
    def check(self, edit, *expected):
        with open(HEADER, encoding="utf-8") as f:
            src = f.read()
        new = edit(src)
        self.assertNotEqual(new, src, "the edit changed nothing")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "roundpipe.h")
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            status, err = gate(header=path, **PATHS)
        self.assertEqual(status, 1, "the gate passed a broken header")
        for text in expected:
            self.assertIn(text, err)

    def test_function_without_prefix(self):
        self.check(lambda s: s.replace("RP_API rp_status rp_zero_grad(",
                                       "RP_API rp_status zero_grad("),
                   "header: zero_grad: function name lacks the rp_ prefix")

    def test_destroy_returning_status(self):
        self.check(lambda s: s.replace("RP_API void rp_loss_destroy(",
                                       "RP_API rp_status rp_loss_destroy("),
                   "header: rp_loss_destroy: destroy function returns rp_status")

    def test_fallible_call_returning_void(self):
        self.check(lambda s: s.replace("RP_API rp_status rp_zero_grad(",
                                       "RP_API void rp_zero_grad("),
                   "header: rp_zero_grad: returns void; only rp_*_destroy may")

    def test_fallible_call_returning_a_value(self):
        self.check(lambda s: s.replace("RP_API rp_status rp_synchronize(",
                                       "RP_API int32_t rp_synchronize("),
                   "header: rp_synchronize: returns int32_t but takes pointer parameters")

    def test_create_without_destroy(self):
        self.check(lambda s: re.sub(r"/\*\* Free optimizer settings.*?\n"
                                    r"RP_API void rp_optimizer_destroy\(rp_optimizer \*optimizer\);",
                                    "", s, flags=re.S),
                   "header: rp_optimizer_create: has no matching rp_optimizer_destroy",
                   "header: rp_optimizer: opaque handle has no rp_optimizer_destroy")

    def test_lent_handle_that_a_call_produces_needs_a_destroy(self):
        # rp_layer_call is lent to callbacks only (const, never produced): no destroy needed.
        # Once a call hands one out, the caller owns it and must be able to free it.
        self.check(lambda s: s.replace(
            "RP_API rp_status rp_cuda_device_count(int32_t *out_count);",
            "RP_API rp_status rp_cuda_device_count(int32_t *out_count);\n"
            "RP_API rp_status rp_layer_call_copy(rp_layer_call **out_call, "
            "const rp_layer_call *call);"),
            "header: rp_layer_call: opaque handle has no rp_layer_call_destroy")

    def test_lent_handle_passed_mutable_needs_a_destroy(self):
        self.check(lambda s: s.replace(
            "int32_t *out_microbatch, int32_t *out_training,\n"
            "                                    const rp_layer_call *call);",
            "int32_t *out_microbatch, int32_t *out_training,\n"
            "                                    rp_layer_call *call);"),
            "header: rp_layer_call: opaque handle has no rp_layer_call_destroy")

    def test_callback_user_data_not_last(self):
        self.check(lambda s: s.replace(
            "typedef int32_t (*rp_step_fn)(rp_model *model, void *user_data);",
            "typedef int32_t (*rp_step_fn)(void *user_data, rp_model *model);"),
            "header: rp_step_fn: callback typedef must take `void *user_data` as its last "
            "parameter")

    def test_struct_by_value(self):
        self.check(lambda s: s.replace(
            "RP_API rp_status rp_cuda_device_count(int32_t *out_count);",
            "RP_API rp_status rp_cuda_device_count(int32_t *out_count);\n"
            "RP_API rp_status rp_device_name(const char **out_name, DLDevice device);"),
            "header: rp_device_name: parameter 2 (device) passes struct DLDevice by value")

    def test_out_parameter_after_input(self):
        self.check(lambda s: s.replace(
            "RP_API rp_status rp_model_num_layers(int32_t *out_count, const rp_model *model);",
            "RP_API rp_status rp_model_num_layers(const rp_model *model, int32_t *out_count);"),
            "header: rp_model_num_layers: out-parameter out_count comes after input model")

    def test_missing_export_macro(self):
        self.check(lambda s: s.replace("RP_API rp_status rp_zero_grad(",
                                       "rp_status rp_zero_grad("),
                   "header: rp_zero_grad: declaration lacks the RP_API export macro")

    def test_header_change_shows_in_every_binding(self):
        # A parameter added to the header: every binding is now short of one.
        self.check(lambda s: s.replace(
            "RP_API rp_status rp_zero_grad(rp_model *model);",
            "RP_API rp_status rp_zero_grad(rp_model *model, int32_t keep);"),
            "rust: rp_zero_grad: wrong arity: declares 1 parameters, the header has 2",
            "julia: rp_zero_grad: wrong arity",
            "python: rp_zero_grad: wrong arity")


if __name__ == "__main__":
    unittest.main()
