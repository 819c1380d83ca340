"""Read the declarations of the Julia raw layer (bindings/julia/RoundPipe.jl/src/LibRoundPipe.jl).

No Julia runtime exists on our machines, so this reader is what checks the Julia binding. It
understands the subset the raw layer uses:
  `ccall((:name, lib), RetType, (ArgType, ...), args...)`   one per C function
  `const name = Type`                                       type aliases (Cint, Ptr{Cvoid}...)
  `const NAME = 123` / `Cint(123)` / `Int32(-1)`            constants
  `struct Name ... field::Type ... end`                     struct layouts
  `mutable struct rp_model end`                             opaque handles
Every ccall must also pass as many arguments as its type tuple lists.
"""

import re

from .abitypes import Policy, any_, prim, ptr, struct
from .binding import BFunc, Binding

JULIA_PRIMS = {"Int8": "i8", "UInt8": "u8", "Int16": "i16", "UInt16": "u16", "Int32": "i32",
               "UInt32": "u32", "Int64": "i64", "UInt64": "u64", "Int": "i64", "UInt": "u64",
               "Float32": "f32", "Float64": "f64", "Cchar": "char", "Cuchar": "u8",
               "Cshort": "i16", "Cushort": "u16", "Cint": "i32", "Cuint": "u32",
               "Clong": "i64", "Culong": "u64", "Clonglong": "i64", "Culonglong": "u64",
               "Csize_t": "usize", "Cssize_t": "isize", "Cptrdiff_t": "isize",
               "Cintptr_t": "isize", "Cuintptr_t": "usize", "Cfloat": "f32", "Cdouble": "f64",
               "Cvoid": "void", "Nothing": "void", "Bool": "bool"}

# Julia has no const pointers; function pointers are Ptr{Cvoid}.
POLICY = Policy(check_const=False, void_ptr_fn=True)


def _strip_comments(text):
    """Julia comments (# and nested #= =#) blanked out; strings kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("#=", i):
            depth, j = 0, i
            while j < n:
                if text.startswith("#=", j):
                    depth += 1
                    j += 2
                elif text.startswith("=#", j):
                    depth -= 1
                    j += 2
                    if depth == 0:
                        break
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text[i] == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith('"""', i):
            j = text.find('"""', i + 3)
            j = n if j < 0 else j + 3
            out.append(re.sub(r"[^\n]", " ", text[i:j]))  # docstrings: no code inside
            i = j
        elif text[i] == '"':
            m = re.compile(r'"(?:\\.|[^"\\])*"').match(text, i)
            j = m.end() if m else n
            out.append(text[i:j])
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _matching(text, i):
    """Index of the bracket closing the one at text[i]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[text[i]]]
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == '"':
            m = re.compile(r'"(?:\\.|[^"\\])*"').match(text, j)
            j = m.end() if m else len(text)
            continue
        if ch in pairs:
            stack.append(pairs[ch])
        elif ch in ")}]":
            if not stack or ch != stack[-1]:
                raise SyntaxError("unbalanced %r" % ch)
            stack.pop()
            if not stack:
                return j
        j += 1
    raise SyntaxError("unclosed bracket")


def _split_top(s):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


_TYPE_RE = re.compile(r"^[A-Za-z_][\w.]*(\{.*\})?$", re.S)


def _is_type_expr(s):
    s = s.strip()
    return bool(_TYPE_RE.match(s)) and not re.match(r"^\d", s)


def _resolve(s, aliases, structs, depth=0):
    s = re.sub(r"\s+", "", s)
    if depth > 40:
        return any_("alias cycle")
    m = re.match(r"^(Ptr|Ref)\{(.*)\}$", s)
    if m:
        return ptr(_resolve(m.group(2), aliases, structs, depth + 1))
    if s == "Cstring":
        return ptr(prim("char"), const=True)
    if s == "Cwstring":
        return any_("Cwstring")
    base = s.split(".")[-1]  # Base.Cint, LibRoundPipe.rp_model
    if base in JULIA_PRIMS:
        return prim(JULIA_PRIMS[base])
    if base in aliases:
        return _resolve(aliases[base], aliases, structs, depth + 1)
    if base in structs:
        return struct(base)
    return any_("unknown Julia type %s" % s)


def _int_value(s):
    s = re.sub(r"\s+", "", s)
    m = re.match(r"^(?:[A-Za-z]\w*)?\(?(-?(?:0x[0-9a-fA-F_]+|\d[\d_]*))\)?$", s)
    if not m:
        return None
    return int(m.group(1).replace("_", ""), 0)


def parse_julia(path, name="julia"):
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    text = _strip_comments(raw)
    b = Binding(name=name, path=path, policy=POLICY, require_structs=True, require_constants=True,
                abi_constant="RP_ABI_VERSION")

    def line_at(pos):
        return text.count("\n", 0, pos) + 1

    aliases, structs = {}, {}
    for m in re.finditer(r"^\s*const\s+([A-Za-z_]\w*)\s*=\s*(.+?)\s*$", text, re.M):
        nm, rhs = m.group(1), m.group(2)
        v = _int_value(rhs)
        if v is not None:
            b.constants[nm] = (v, line_at(m.start()))
        elif _is_type_expr(rhs):
            aliases[nm] = rhs
    opaque = set()
    for m in re.finditer(r"^[ \t]*(?:mutable\s+)?struct\s+([A-Za-z_]\w*)[ \t]+end\b|"
                         r"^[ \t]*(?:mutable\s+)?struct\s+([A-Za-z_]\w*)(.*?)^\s*end\b",
                         text, re.M | re.S):
        nm = m.group(1) or m.group(2)
        body = m.group(3) or ""
        fields = re.findall(r"^\s*([A-Za-z_]\w*)\s*::\s*(\S[^\n]*?)\s*$", body, re.M)
        structs[nm] = (fields, line_at(m.start()))
        if not fields:
            opaque.add(nm)
    for nm, (fields, line) in structs.items():
        if nm in opaque:
            continue
        b.structs[nm] = [(f, _resolve(t, aliases, structs)) for f, t in fields]
        b.struct_lines[nm] = line
    for nm in list(aliases):
        if nm.startswith("rp_") and nm.endswith("_fn"):
            b.callbacks[nm] = (_resolve(aliases[nm], aliases, structs), 0)

    for m in re.finditer(r"(?<![\w@.])ccall\s*\(", text):
        line = line_at(m.start())
        open_at = m.end() - 1
        try:
            close = _matching(text, open_at)
        except SyntaxError as e:
            b.problems.append(("(parse)", "ccall at line %d: %s" % (line, e), line))
            continue
        args = _split_top(text[open_at + 1:close])
        if len(args) < 3:
            b.problems.append(("(parse)", "ccall at line %d has fewer than 3 arguments" % line, line))
            continue
        target = args[0]
        sm = re.match(r"^\(\s*[:\"]([A-Za-z_]\w*)\"?\s*,", target) or \
            re.match(r"^[:\"]([A-Za-z_]\w*)\"?$", target)
        if not sm:
            b.problems.append(("(parse)", "ccall at line %d: cannot read the C name from %r"
                               % (line, target), line))
            continue
        cname = sm.group(1)
        tup = args[2].strip()
        if not (tup.startswith("(") and tup.endswith(")")):
            b.problems.append((cname, "the argument types must be a literal tuple", line))
            continue
        types = _split_top(tup[1:-1])
        values = args[3:]
        if len(values) != len(types):
            b.problems.append((cname, "ccall passes %d arguments for %d argument types"
                               % (len(values), len(types)), line))
        bf = BFunc(cname, _resolve(args[1], aliases, structs),
                   [_resolve(t, aliases, structs) for t in types], [None] * len(types), line)
        bf.text = "ccall((:%s, ...), %s, (%s))" % (cname, args[1].strip(), ", ".join(types))
        b.add_function(bf)
    return b
