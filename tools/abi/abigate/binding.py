"""What a binding declares, and its comparison with the header."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .abitypes import Policy, T, mismatch, render


@dataclass
class BFunc:
    name: str
    ret: T
    params: List[T]
    names: List[Optional[str]]
    line: int
    text: str = ""  # the binding's own spelling of the declaration, for messages


@dataclass
class Binding:
    name: str  # "python", "julia", "rust"
    path: str  # file the declarations were read from
    policy: Policy
    functions: Dict[str, BFunc] = field(default_factory=dict)
    structs: Dict[str, List[Tuple[str, T]]] = field(default_factory=dict)
    struct_lines: Dict[str, int] = field(default_factory=dict)
    constants: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # name -> (value, line)
    callbacks: Dict[str, Tuple[T, int]] = field(default_factory=dict)  # header typedef names
    problems: List[Tuple[str, str, int]] = field(default_factory=list)  # (subject, msg, line)
    require_structs: bool = False  # every non-opaque header struct must be declared
    require_constants: bool = False  # every header enumerator / macro must be declared
    require_callbacks: bool = False  # every callback typedef must be declared by name
    # Name of the constant holding the ABI version the binding was written for (compared with
    # rp_abi_version() at load); it must equal the header's RP_ABI_VERSION.
    abi_constant: Optional[str] = None

    def add_function(self, f):
        if f.name in self.functions:
            self.problems.append((f.name, "declared twice (lines %d and %d)"
                                  % (self.functions[f.name].line, f.line), f.line))
        self.functions[f.name] = f


def _sig(name, ret, params):
    return "%s %s(%s)" % (render(ret), name, ", ".join(render(p) for p in params) or "void")


ABI_MACRO = "RP_ABI_VERSION"


def check_abi_version(hdr, b):
    """(subject, message, line) when binding `b`'s ABI version constant is missing or differs
    from the header's RP_ABI_VERSION, the one source of the ABI version; else None."""
    want = hdr.constants.get(ABI_MACRO)
    if b.abi_constant is None or want is None:  # a header without the macro: conventions say so
        return None
    where = "include/roundpipe.h:%d" % hdr.define_line(ABI_MACRO)
    if b.abi_constant not in b.constants:
        return (b.abi_constant, "missing ABI version constant: declare %s = %d, the header's "
                "%s (%s), which is its one source" % (b.abi_constant, want, ABI_MACRO, where), 0)
    got, line = b.constants[b.abi_constant]
    if got != want:
        return (b.abi_constant, "ABI version is %d, the header's %s is %d (%s), which is its one "
                "source: set %s to %d" % (got, ABI_MACRO, want, where, b.abi_constant, want), line)
    return None


def compare(hdr, b):
    """List of (subject, message, line) where binding `b` disagrees with header `hdr`."""
    out = list(b.problems)
    abi = check_abi_version(hdr, b)
    if abi is not None:
        out.append(abi)
    pol = b.policy

    for name, cf in hdr.functions.items():
        bf = b.functions.get(name)
        if bf is None:
            out.append((name, "missing: the header declares `%s` (include/roundpipe.h:%d)"
                        % (cf.prototype(), cf.line), 0))
            continue
        if len(bf.params) != len(cf.params):
            out.append((name, "wrong arity: declares %d parameters, the header has %d: `%s`"
                        % (len(bf.params), len(cf.params), cf.prototype()), bf.line))
            continue
        why = mismatch(cf.ret, bf.ret, pol)
        if why:
            out.append((name, "return type: binding has %s, the header has %s (%s)"
                        % (render(bf.ret), render(cf.ret), why), bf.line))
        for i, (cp, bp) in enumerate(zip(cf.params, bf.params)):
            why = mismatch(cp.type, bp, pol)
            if why:
                out.append((name, "parameter %d (%s): binding has %s, the header has %s (%s)"
                            % (i + 1, cp.name, render(bp), render(cp.type), why), bf.line))
    for name, bf in b.functions.items():
        if name not in hdr.functions:
            out.append((name, "extra function: not in the header (declared as `%s`)"
                        % (bf.text or _sig(name, bf.ret, bf.params)), bf.line))

    # Callback typedefs declared under the header's names.
    for name, ct in hdr.callbacks.items():
        if name not in b.callbacks:
            if b.require_callbacks:
                out.append((name, "missing callback type: the header declares `%s`"
                            % render(ct.inner, "*" + name), 0))
            continue
        bt, line = b.callbacks[name]
        why = mismatch(ct, bt, pol)
        if why:
            out.append((name, "callback type: binding has %s, the header has %s (%s)"
                        % (render(bt), render(ct.inner, "*" + name), why), line))

    # Structs with a layout: same fields, same order, same types.
    for name, cs in hdr.structs.items():
        if cs.opaque:
            continue
        if name not in b.structs:
            if b.require_structs:
                out.append((name, "missing struct: the header declares %s with %d fields"
                            % (name, len(cs.fields)), 0))
            continue
        fields = b.structs[name]
        line = b.struct_lines.get(name, 0)
        if len(fields) != len(cs.fields):
            out.append((name, "struct has %d fields, the header's has %d (%s)"
                        % (len(fields), len(cs.fields), ", ".join(p.name for p in cs.fields)),
                        line))
            continue
        for (fname, ft), cp in zip(fields, cs.fields):
            why = mismatch(cp.type, ft, pol)
            if why:
                out.append((name, "field %s: binding has %s, the header's %s is %s (%s)"
                            % (fname, render(ft), cp.name, render(cp.type), why), line))

    # Constants named as in the header carry the header's values.
    for cname, (val, line) in b.constants.items():
        if cname == b.abi_constant:
            continue  # check_abi_version's job
        if cname in hdr.constants:
            if hdr.constants[cname] != val:
                out.append((cname, "constant is %d, the header says %d"
                            % (val, hdr.constants[cname]), line))
        elif b.require_constants and cname.startswith(("RP_", "kDL", "DLPACK_")):
            out.append((cname, "extra constant: not in the header", line))
    if b.require_constants:
        for cname in hdr.constants:
            if cname not in b.constants and cname != b.abi_constant:
                out.append((cname, "missing constant (the header says %d)"
                            % hdr.constants[cname], 0))
    return out
