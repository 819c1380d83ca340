"""Read the ctypes declarations of the Python binding (bindings/python/roundpipe/_capi.py).

The module is parsed with `ast`, never imported (importing it loads torch and the library).
Two declaration forms are understood:
  fn("rp_name", restype, [argtypes...])      any call whose first argument is an "rp_*" string,
                                             followed by the return type and a list of argument
                                             types (the form _capi.py uses)
  lib.rp_name.argtypes = [...]               attribute assignments, merged per function
  lib.rp_name.restype = ...                  (used only for functions the first form lacks)
Types are resolved through ctypes names, module and function-local aliases (P = POINTER),
Structure subclasses (checked field by field when named as in the header), c_void_p subclasses
named `<handle>_p` (typed handles: rp_model_p stands for rp_model *), CFUNCTYPE(...) callback
types, and a name bound to `object()` used as restype, which _capi.py uses to mean "rp_status
with an errcheck".
The C prototype in the comment beside a declaration is compared with the header too (a
mismatch is a warning: the comment is stale).
"""

import ast
import io
import re
import tokenize

from .abitypes import Policy, any_, enum, fn, prim, ptr, struct
from .binding import BFunc, Binding

CTYPES = {"c_bool": "bool", "c_char": "char", "c_byte": "i8", "c_ubyte": "u8",
          "c_short": "i16", "c_ushort": "u16", "c_int": "i32", "c_uint": "u32",
          "c_long": "i64", "c_ulong": "u64", "c_longlong": "i64", "c_ulonglong": "u64",
          "c_int8": "i8", "c_uint8": "u8", "c_int16": "i16", "c_uint16": "u16",
          "c_int32": "i32", "c_uint32": "u32", "c_int64": "i64", "c_uint64": "u64",
          "c_size_t": "usize", "c_ssize_t": "isize", "c_float": "f32", "c_double": "f64"}

# ctypes has no const, and c_void_p is how ctypes code passes most pointers.
POLICY = Policy(check_const=False, void_ptr_any=True)


def _name_of(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Env:
    def __init__(self, tree, hdr):
        self.aliases = {}  # name -> expr
        self.classes = {}  # name -> (base names, fields expr or None, line)
        self.sentinels = set()  # names bound to object()
        self.hdr = hdr
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [_name_of(b) for b in node.bases]
                fields = None
                for st in node.body:
                    if (isinstance(st, ast.Assign) and len(st.targets) == 1
                            and _name_of(st.targets[0]) == "_fields_"):
                        fields = st.value
                self.classes[node.name] = [bases, fields, node.lineno]
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                tgt = node.targets[0]
                if isinstance(tgt, ast.Name):
                    v = node.value
                    if (isinstance(v, ast.Call) and _name_of(v.func) == "object"
                            and not v.args):
                        self.sentinels.add(tgt.id)
                    else:
                        self.aliases.setdefault(tgt.id, v)
                elif (isinstance(tgt, ast.Attribute) and tgt.attr == "_fields_"
                      and isinstance(tgt.value, ast.Name) and tgt.value.id in self.classes):
                    self.classes[tgt.value.id][1] = node.value

    def is_structure(self, name, depth=0):
        if name in ("Structure", "Union"):
            return True
        if name not in self.classes or depth > 20:
            return False
        return any(self.is_structure(b, depth + 1) for b in self.classes[name][0] if b)

    def is_void_p(self, name, depth=0):
        if name == "c_void_p":
            return True
        if name not in self.classes or depth > 20:
            return False
        return any(self.is_void_p(b, depth + 1) for b in self.classes[name][0] if b)

    def resolve(self, node, depth=0):
        if depth > 40:
            return any_("alias cycle")
        if node is None or (isinstance(node, ast.Constant) and node.value is None):
            return prim("void")
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _name_of(node)
            if name in self.sentinels:
                return enum("rp_status")
            if name in CTYPES:
                return prim(CTYPES[name])
            if name == "c_char_p":
                return ptr(prim("char"))
            if name == "c_void_p":
                return ptr(prim("void"))
            if name in self.classes:
                if self.is_structure(name):
                    return struct(name if name in self.hdr.structs else None)
                if self.is_void_p(name):
                    handle = name[:-2] if name.endswith("_p") else None
                    if handle in self.hdr.structs and self.hdr.structs[handle].opaque:
                        return ptr(struct(handle))
                    return ptr(prim("void"))
                return any_("class %s" % name)
            if isinstance(node, ast.Name) and name in self.aliases:
                return self.resolve(self.aliases[name], depth + 1)
            return any_("unknown Python name %s" % name)
        if isinstance(node, ast.Call):
            callee = self._callee(node.func, depth)
            if callee == "POINTER" and len(node.args) == 1:
                return ptr(self.resolve(node.args[0], depth + 1))
            if callee in ("CFUNCTYPE", "PYFUNCTYPE") and node.args:
                ret = self.resolve(node.args[0], depth + 1)
                return ptr(fn(ret, [self.resolve(a, depth + 1) for a in node.args[1:]]))
            return any_("call")
        return any_(type(node).__name__)

    def _callee(self, f, depth):
        name = _name_of(f)
        seen = 0
        while isinstance(f, ast.Name) and name in self.aliases and seen < 10:
            f = self.aliases[name]
            name = _name_of(f)
            seen += 1
        return name


def _comments(source):
    """Line number -> comment text (without '#')."""
    out = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = tok.string.lstrip("#").strip()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def _norm_proto(s):
    s = re.sub(r"\s+", " ", s.strip().rstrip(";"))
    s = re.sub(r"\s*\*\s*", "*", s)
    s = re.sub(r"\s*([(),])\s*", r"\1", s)
    return s


def parse_python(path, hdr, name="python"):
    with open(path, encoding="utf-8") as f:
        source = f.read()
    b = Binding(name=name, path=path, policy=POLICY, abi_constant="ABI_VERSION")
    b.warnings = []
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        b.problems.append(("(parse)", "%s does not parse: %s" % (path, e), e.lineno or 0))
        return b
    env = _Env(tree, hdr)
    comments = _comments(source)

    def add(cname, ret_node, args_node, line, end_line):
        if not isinstance(args_node, (ast.List, ast.Tuple)):
            b.problems.append((cname, "argument types are not a literal list", line))
            return
        params = [env.resolve(a) for a in args_node.elts]
        bf = BFunc(cname, env.resolve(ret_node), params, [None] * len(params), line)
        bf.text = ast.get_source_segment(source, args_node) or ""
        bf.text = "%s(%s)" % (cname, bf.text.strip("[]()"))
        b.add_function(bf)
        cf = hdr.functions.get(cname)
        if cf is None:
            return
        for ln in range(line, end_line + 1):
            c = comments.get(ln, "")
            if re.search(r"\b%s\s*\(" % re.escape(cname), c):
                if _norm_proto(c) != _norm_proto(cf.prototype()):
                    b.warnings.append((cname, "prototype comment `%s` differs from the "
                                       "header's `%s`" % (c, cf.prototype()), ln))
                break

    attr_decls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            a0 = node.args[0]
            if (isinstance(a0, ast.Constant) and isinstance(a0.value, str)
                    and a0.value.startswith("rp_") and len(node.args) >= 3):
                rest = node.args[1:3]
                if isinstance(rest[0], (ast.List, ast.Tuple)):
                    args_node, ret_node = rest
                else:
                    ret_node, args_node = rest
                add(a0.value, ret_node, args_node, node.lineno,
                    getattr(node, "end_lineno", node.lineno))
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            tgt = node.targets[0]
            if (isinstance(tgt, ast.Attribute) and tgt.attr in ("argtypes", "restype")
                    and isinstance(tgt.value, ast.Attribute)
                    and tgt.value.attr.startswith("rp_")):
                d = attr_decls.setdefault(tgt.value.attr, {"line": node.lineno,
                                                            "end": node.lineno})
                d[tgt.attr] = node.value
                d["end"] = max(d["end"], getattr(node, "end_lineno", node.lineno))
    for cname, d in attr_decls.items():
        if cname in b.functions:
            continue
        if "argtypes" not in d:
            b.problems.append((cname, "restype set but no argtypes declared", d["line"]))
            continue
        add(cname, d.get("restype", ast.Name("c_int", ast.Load())), d["argtypes"], d["line"],
            d["end"])

    # Structure layouts named as in the header.
    for cname, (bases, fields, line) in env.classes.items():
        if cname not in hdr.structs or not env.is_structure(cname) or fields is None:
            continue
        if not isinstance(fields, (ast.List, ast.Tuple)):
            continue
        out = []
        for el in fields.elts:
            if isinstance(el, (ast.Tuple, ast.List)) and len(el.elts) >= 2 and \
                    isinstance(el.elts[0], ast.Constant):
                out.append((el.elts[0].value, env.resolve(el.elts[1])))
        b.structs[cname] = out
        b.struct_lines[cname] = line

    # Callback types named as in the header, and constants.
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for tgt in node.targets:
            if isinstance(tgt, ast.Name):
                if tgt.id in hdr.callbacks:
                    b.callbacks[tgt.id] = (env.resolve(node.value), node.lineno)
                v = _const(node.value)
                if v is not None:
                    b.constants[tgt.id] = (v, node.lineno)
            elif isinstance(tgt, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                    and len(tgt.elts) == len(node.value.elts):
                for t, v in zip(tgt.elts, node.value.elts):
                    c = _const(v)
                    if isinstance(t, ast.Name) and c is not None:
                        b.constants[t.id] = (c, node.lineno)
    return b


def _const(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _const(node.operand)
        return -v if v is not None else None
    return None
