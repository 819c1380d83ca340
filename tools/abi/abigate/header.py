"""The header as SWIG sees it: run `swig -xml`, read every declaration of roundpipe.h."""

import ast
import os
import re
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .abitypes import T, any_, enum, fn, prim, ptr, render, struct

# C base types -> fixed-size kinds (LP64, the only data model we build for).
C_BASE = {
    "void": "void", "char": "char", "bool": "bool", "_Bool": "bool",
    "signed char": "i8", "unsigned char": "u8", "short": "i16", "unsigned short": "u16",
    "int": "i32", "unsigned int": "u32", "long": "i64", "unsigned long": "u64",
    "long long": "i64", "unsigned long long": "u64", "float": "f32", "double": "f64",
    "int8_t": "i8", "uint8_t": "u8", "int16_t": "i16", "uint16_t": "u16",
    "int32_t": "i32", "uint32_t": "u32", "int64_t": "i64", "uint64_t": "u64",
    "size_t": "usize", "ptrdiff_t": "isize", "intptr_t": "isize", "uintptr_t": "usize",
    "ssize_t": "isize",
}


class GateError(Exception):
    """The gate could not run (no swig, header does not parse...)."""


@dataclass
class Param:
    name: str
    type: T

    def c(self):
        return render(self.type, self.name)


@dataclass
class Function:
    name: str
    ret: T
    params: List[Param]
    line: int = 0

    def prototype(self):
        params = ", ".join(p.c() for p in self.params) or "void"
        ret = render(self.ret)
        return "%s%s%s(%s);" % (ret, "" if ret.endswith("*") else " ", self.name, params)


@dataclass
class Struct:
    name: str
    fields: List[Param]  # empty for opaque handles
    opaque: bool


@dataclass
class Enum:
    name: str
    items: List[Tuple[str, int]]


@dataclass
class Header:
    path: str
    text: str
    functions: Dict[str, Function] = field(default_factory=dict)
    callbacks: Dict[str, T] = field(default_factory=dict)  # typedef name -> ptr(fn)
    callback_params: Dict[str, List[str]] = field(default_factory=dict)  # names of their params
    structs: Dict[str, Struct] = field(default_factory=dict)
    enums: Dict[str, Enum] = field(default_factory=dict)
    constants: Dict[str, int] = field(default_factory=dict)  # enum items and integer macros

    def line_of(self, name):
        text = _strip_c_comments(self.text)
        m = re.search(r"\b%s\s*\(" % re.escape(name), text)
        return text.count("\n", 0, m.start()) + 1 if m else 0

    def define_line(self, name):
        """Line of `#define name ...` (0 when absent)."""
        m = re.search(r"^[ \t]*#[ \t]*define[ \t]+%s\b" % re.escape(name),
                      _strip_c_comments(self.text), re.M)
        return self.text.count("\n", 0, m.start()) + 1 if m else 0


def default_header():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.normpath(os.path.join(here, "..", "..", "include", "roundpipe.h"))


def interface_file():
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "roundpipe.i")


def run_swig(header_path, swig="swig"):
    """Dump the header with `swig -xml` through tools/abi/roundpipe.i; returns the XML text."""
    exe = shutil.which(swig)
    if exe is None:
        raise GateError("swig not found (looked for %r on PATH); install SWIG 4.x "
                        "(Debian: apt-get install swig)" % swig)
    header_path = os.path.abspath(header_path)
    if not os.path.isfile(header_path):
        raise GateError("header not found: %s" % header_path)
    with tempfile.TemporaryDirectory(prefix="rp-abi-") as tmp:
        # The interface includes "roundpipe.h"; a copy named so lets the gate check any header
        # file (tests check deliberately broken copies).
        shutil.copyfile(header_path, os.path.join(tmp, "roundpipe.h"))
        shutil.copyfile(interface_file(), os.path.join(tmp, "roundpipe.i"))
        out = os.path.join(tmp, "roundpipe.xml")
        proc = subprocess.run([exe, "-xml", "-I" + tmp, "-o", out, os.path.join(tmp, "roundpipe.i")],
                              cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise GateError("swig -xml failed on %s:\n%s%s" % (header_path, proc.stdout, proc.stderr))
        with open(out, encoding="utf-8") as f:
            return f.read()


def _attrs(node):
    al = node.find("attributelist")
    if al is None:
        return {}
    return {a.get("name"): a.get("value") for a in al.findall("attribute")}


def _split_top(s):
    """Split a SWIG parameter list on commas outside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def _close_paren(s, start):
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "(":
            depth += 1
        elif s[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise GateError("unbalanced SWIG type string: %r" % s)


def _eval_int(expr, names):
    """Integer value of a C constant expression made of literals, operators and known names."""
    expr = expr.strip()
    expr = re.sub(r"(?<=\d)[uUlL]+\b", "", expr)

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            return {ast.USub: -v, ast.UAdd: v, ast.Invert: ~v}[type(node.op)]
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
                   ast.LShift: lambda: a << b, ast.RShift: lambda: a >> b,
                   ast.BitOr: lambda: a | b, ast.BitAnd: lambda: a & b}
            return ops[type(node.op)]()
        raise ValueError(expr)

    try:
        return ev(ast.parse(expr, mode="eval"))
    except (SyntaxError, ValueError, KeyError):
        return None


class _Resolver:
    def __init__(self):
        self.typedefs = {}  # name -> full SWIG type string
        self.enum_tags = {}  # "enum $unnamed2$" or "enum rp_status" -> typedef name
        self.struct_names = set()

    def parse(self, s):
        t, _ = self._parse(s)
        return t

    def _parse(self, s, depth=0):
        """(type, top-level const) of a SWIG type string such as p.q(const).char."""
        if depth > 50:
            raise GateError("typedef cycle at %r" % s)
        if s.startswith("p."):
            inner, c = self._parse(s[2:], depth + 1)
            return ptr(inner, const=c), False
        if s.startswith("r."):  # C++ reference; not in a C header, treat as pointer
            inner, c = self._parse(s[2:], depth + 1)
            return ptr(inner, const=c), False
        if s.startswith("q("):
            close = _close_paren(s, 1)
            quals = s[2:close].split()
            inner, _ = self._parse(s[close + 2:], depth + 1)
            return inner, "const" in quals
        if s.startswith("a("):
            close = _close_paren(s, 1)
            inner, c = self._parse(s[close + 2:], depth + 1)
            return ptr(inner, const=c), False
        if s.startswith("f("):
            close = _close_paren(s, 1)
            args = [a for a in _split_top(s[2:close]) if a.strip()]
            if args == ["void"]:
                args = []
            ret, _ = self._parse(s[close + 2:], depth + 1)
            return fn(ret, [self._parse(a, depth + 1)[0] for a in args]), False
        base = s.strip()
        if base in C_BASE:
            return prim(C_BASE[base]), False
        if base.startswith("struct "):
            return struct(base[len("struct "):].strip()), False
        if base.startswith("enum "):
            return enum(self.enum_tags.get(base, base[len("enum "):].strip())), False
        if base in self.typedefs:
            t, c = self._parse(self.typedefs[base], depth + 1)
            if t.kind == "ptr" and t.inner.kind == "fn":
                t = T("ptr", name=base, inner=t.inner)  # keep the callback typedef's name
            return t, c
        return any_("unknown C type %s" % base), False


def parse_header(header_path, swig="swig", xml_text=None):
    """Header model of `header_path` (XML from swig unless `xml_text` is given)."""
    if xml_text is None:
        xml_text = run_swig(header_path, swig)
    with open(header_path, encoding="utf-8") as f:
        text = f.read()
    root = ET.fromstring(xml_text)
    top = None
    for inc in root.iter("include"):
        name = _attrs(inc).get("name", "")
        if os.path.basename(name) == "roundpipe.h":
            top = inc
    if top is None:
        raise GateError("swig output holds no declarations of roundpipe.h")

    hdr = Header(path=header_path, text=text)
    res = _Resolver()
    nodes = [n for n in top.iter() if n.tag in ("cdecl", "class", "enum", "constant")]

    # Pass 1: names of typedefs, structs and enums.
    for n in nodes:
        a = _attrs(n)
        if n.tag == "enum":
            name = a.get("tdname") or a.get("name")
            if a.get("unnamed"):
                res.enum_tags["enum " + a["unnamed"]] = name
            res.enum_tags["enum " + a.get("name", name)] = name
        elif n.tag == "class":
            res.struct_names.add(a.get("tdname") or a.get("name"))
        elif n.tag == "cdecl" and a.get("kind") == "typedef":
            res.typedefs[a["name"]] = a.get("decl", "") + a.get("type", "")

    # A typedef of a struct names the struct: "rp_model" -> struct rp_model; for an unnamed
    # struct SWIG already reports the typedef name.
    for name, s in list(res.typedefs.items()):
        if s.startswith("struct "):
            tag = s[len("struct "):]
            res.typedefs[name] = "struct " + (name if tag.startswith("$") else tag)
        if s.startswith("enum "):
            res.enum_tags[s] = name

    # Pass 2: declarations.
    for n in nodes:
        a = _attrs(n)
        if n.tag == "cdecl" and a.get("kind") == "function":
            full = a.get("decl", "") + a.get("type", "")
            ftype = res.parse(full)
            params = []
            plist = n.find("attributelist/parmlist")
            if plist is not None:
                for i, p in enumerate(plist.findall("parm")):
                    pa = _attrs(p)
                    if pa.get("type") == "void" and "name" not in pa:
                        continue
                    params.append(Param(pa.get("name", "arg%d" % (i + 1)), res.parse(pa["type"])))
            hdr.functions[a["name"]] = Function(a["name"], ftype.ret, params)
        elif n.tag == "cdecl" and a.get("kind") == "typedef":
            t = res.parse(a.get("decl", "") + a.get("type", ""))
            if t.kind == "ptr" and t.inner.kind == "fn":
                hdr.callbacks[a["name"]] = t
                hdr.callback_params[a["name"]] = _callback_param_names(text, a["name"])
            elif a.get("type", "").startswith("struct ") and a["name"] not in res.struct_names:
                hdr.structs[a["name"]] = Struct(a["name"], [], opaque=True)
        elif n.tag == "class":
            name = a.get("tdname") or a.get("name")
            fields = []
            for c in n:
                if c.tag != "cdecl":
                    continue
                ca = _attrs(c)
                if ca.get("kind") == "variable":
                    fields.append(Param(ca["name"], res.parse(ca.get("decl", "") + ca["type"])))
            hdr.structs[name] = Struct(name, fields, opaque=False)
        elif n.tag == "enum":
            name = a.get("tdname") or a.get("name")
            items, prev = [], -1
            for it in n.iter("enumitem"):
                ia = _attrs(it)
                v = ia.get("enumvalue")
                val = _eval_int(v, hdr.constants) if v is not None else prev + 1
                if val is None:
                    val = prev + 1
                items.append((ia["name"], val))
                hdr.constants[ia["name"]] = val
                prev = val
            hdr.enums[name] = Enum(name, items)
        elif n.tag == "constant":
            val = _eval_int(a.get("value", ""), hdr.constants)
            if val is not None:
                hdr.constants[a["name"]] = val

    for f in hdr.functions.values():
        f.line = hdr.line_of(f.name)
    return hdr


def _callback_param_names(text, typedef_name):
    """Parameter names of a function-pointer typedef, read from the header text (SWIG drops them)."""
    m = re.search(r"typedef[^;]*\(\s*\*\s*%s\s*\)\s*\(([^;]*)\)\s*;" % re.escape(typedef_name),
                  _strip_c_comments(text))
    if not m:
        return []
    names = []
    for p in m.group(1).split(","):
        words = re.findall(r"[A-Za-z_]\w*", p)
        names.append(words[-1] if words else "")
    return names


def _strip_c_comments(text):
    """Comments replaced by spaces (newlines kept, so offsets and line numbers stay put)."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r"/\*.*?\*/|//[^\n]*", blank, text, flags=re.S)
