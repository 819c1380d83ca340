"""A small model of C types at the ABI level, shared by the header and every binding parser.

A type is a frozen `T`. Kinds:
  prim    name in PRIMS: fixed-size integers (i8..u64, isize, usize), f32, f64, void, char, bool
  ptr     pointer to `inner`; `const` tells whether the pointee is const-qualified
  struct  a C struct, by name (name None: a binding type the checker cannot name; matches any)
  enum    a C enum, by name; passed as a C int (i32 on every platform we support)
  fn      a function type with `ret` and `params`; a callback parameter is ptr(fn)
  any     a binding type the parser could not resolve; matches anything (name says why)
"""

from dataclasses import dataclass, field
from typing import Optional, Tuple

PRIMS = {"void", "char", "bool", "i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64",
         "isize", "usize", "f32", "f64"}

# C spellings, for messages.
C_NAMES = {"void": "void", "char": "char", "bool": "bool", "i8": "int8_t", "u8": "uint8_t",
           "i16": "int16_t", "u16": "uint16_t", "i32": "int32_t", "u32": "uint32_t",
           "i64": "int64_t", "u64": "uint64_t", "isize": "ptrdiff_t", "usize": "size_t",
           "f32": "float", "f64": "double"}


@dataclass(frozen=True)
class T:
    kind: str
    name: Optional[str] = None
    const: bool = False
    inner: Optional["T"] = None
    ret: Optional["T"] = None
    params: Tuple["T", ...] = field(default_factory=tuple)

    def __str__(self):
        return render(self)


def prim(name):
    assert name in PRIMS, name
    return T("prim", name)


def ptr(inner, const=False):
    return T("ptr", inner=inner, const=const)


def struct(name):
    return T("struct", name)


def enum(name):
    return T("enum", name)


def fn(ret, params):
    return T("fn", ret=ret, params=tuple(params))


def any_(why):
    return T("any", why)


VOID = prim("void")


def render(t, name=""):
    """C spelling of `t`, optionally declaring `name` (for function pointers)."""
    sep = " " if name else ""
    if t is None:
        return "?"
    if t.kind == "prim":
        return C_NAMES[t.name] + sep + name
    if t.kind in ("struct", "enum"):
        return (t.name or "struct <any>") + sep + name
    if t.kind == "any":
        return "<%s>" % t.name + sep + name
    if t.kind == "fn":
        params = ", ".join(render(p) for p in t.params) or "void"
        return "%s (%s)(%s)" % (render(t.ret), name, params)
    if t.kind == "ptr":
        inner = t.inner
        if t.name:  # a named function-pointer typedef
            return t.name + sep + name
        if inner.kind == "fn":
            return render(inner, "*" + name)
        base = render(inner)
        if t.const:
            base = base + "const" if inner.kind == "ptr" else "const " + base
        return base + ("*" if base.endswith("*") else " *") + name
    return "?"


def as_scalar(t):
    """Enums travel as C int."""
    if t.kind == "enum":
        return prim("i32")
    return t


class Policy:
    """How strictly one binding's types are compared with the header's.

    check_const      pointer constness must match (Rust: *const vs *mut)
    void_ptr_any     a void pointer in the binding stands for any pointer (ctypes c_void_p)
    void_ptr_fn      a void pointer in the binding stands for a function pointer (Julia Ptr{Cvoid})
    """

    def __init__(self, check_const=False, void_ptr_any=False, void_ptr_fn=False):
        self.check_const = check_const
        self.void_ptr_any = void_ptr_any
        self.void_ptr_fn = void_ptr_fn


def mismatch(c, b, pol):
    """None when binding type `b` may stand for header type `c`; else a short reason."""
    if b.kind == "any":
        return None
    c = as_scalar(c)
    b = as_scalar(b)
    if c.kind == "prim":
        if b.kind != "prim":
            return "not a scalar"
        if c.name == "char" or b.name == "char":
            ok = {c.name, b.name} <= {"char", "i8", "u8"}
            return None if ok else "different scalar type"
        return None if c.name == b.name else "different scalar type"
    if c.kind == "ptr":
        if b.kind != "ptr":
            return "not a pointer"
        bi, ci = b.inner, c.inner
        if bi.kind == "prim" and bi.name == "void" and not (ci.kind == "prim" and ci.name == "void"):
            if ci.kind == "fn" and (pol.void_ptr_fn or pol.void_ptr_any):
                return None
            if pol.void_ptr_any:
                return None
            return "void pointer where the header has a typed pointer"
        if bi.kind == "any":
            return None
        if pol.check_const and ci.kind != "fn" and c.const != b.const:
            return "pointee constness differs"
        why = mismatch(ci, bi, pol)
        return None if why is None else "pointee: " + why
    if c.kind == "struct":
        if b.kind != "struct":
            return "not the struct " + c.name
        if b.name is None or b.name == c.name:
            return None
        return "struct %s instead of %s" % (b.name, c.name)
    if c.kind == "fn":
        if b.kind != "fn":
            return "not a function"
        if len(c.params) != len(b.params):
            return "callback takes %d parameters, header's takes %d" % (len(b.params), len(c.params))
        why = mismatch(c.ret, b.ret, pol)
        if why:
            return "callback return: " + why
        for i, (cp, bp) in enumerate(zip(c.params, b.params)):
            why = mismatch(cp, bp, pol)
            if why:
                return "callback parameter %d: %s" % (i + 1, why)
        return None
    return "unsupported header type"
