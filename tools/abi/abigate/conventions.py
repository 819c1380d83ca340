"""The header's own conventions (DESIGN.md section 3), checked on SWIG's view of it."""

import re

from .abitypes import render
from .header import _strip_c_comments

DLPACK_PREFIXES = ("DL", "kDL", "DLPACK_")


def _is_void(t):
    return t.kind == "prim" and t.name == "void"


def _is_status(t):
    return t.kind == "enum" and t.name == "rp_status"


def _has_pointer(f):
    return any(p.type.kind == "ptr" for p in f.params)


def _handle_of(t):
    """Name of the opaque rp_ handle that `t` points at (rp_model * -> rp_model), else None."""
    if t.kind == "ptr" and t.inner is not None and t.inner.kind == "struct":
        return t.inner.name
    return None


def check_conventions(hdr):
    """List of (subject, message) for every convention the header breaks."""
    problems = []

    def bad(subject, msg):
        problems.append((subject, msg))

    opaque = {n for n, s in hdr.structs.items() if s.opaque}

    # Names: the library's symbols and types are rp_-prefixed; DLPack's keep their own names.
    for name in hdr.functions:
        if not name.startswith("rp_"):
            bad(name, "function name lacks the rp_ prefix")
    for name in list(hdr.callbacks) + list(opaque) + list(hdr.enums):
        if not name.startswith(("rp_",) + DLPACK_PREFIXES):
            bad(name, "type name lacks the rp_ prefix")
    for en in hdr.enums.values():
        if en.name.startswith(DLPACK_PREFIXES):
            continue
        for item, _ in en.items:
            if not item.startswith("RP_"):
                bad(item, "enumerator of %s lacks the RP_ prefix" % en.name)

    # Returns: rp_status for fallible calls; void only for *_destroy; other values only from
    # calls that cannot fail (no pointer to validate).
    for f in hdr.functions.values():
        if f.name.endswith("_destroy"):
            if not _is_void(f.ret):
                bad(f.name, "destroy function returns %s; rp_*_destroy must return void"
                    % render(f.ret))
            if len(f.params) != 1 or _handle_of(f.params[0].type) not in opaque:
                bad(f.name, "destroy function must take exactly one handle pointer")
            elif f.params[0].type.const:
                bad(f.name, "destroy function takes a const handle")
            continue
        if _is_void(f.ret):
            bad(f.name, "returns void; only rp_*_destroy may (fallible calls return rp_status)")
        elif not _is_status(f.ret) and _has_pointer(f):
            bad(f.name, "returns %s but takes pointer parameters, so it can fail: fallible calls "
                "return rp_status" % render(f.ret))

    # Structs never cross by value; unknown types never cross at all.
    def check_types(subject, where, t):
        if t.kind == "struct":
            bad(subject, "%s passes struct %s by value" % (where, t.name))
        if t.kind == "any":
            bad(subject, "%s has a type SWIG could not resolve (%s)" % (where, t.name))

    for f in hdr.functions.values():
        check_types(f.name, "return value", f.ret)
        for i, p in enumerate(f.params):
            check_types(f.name, "parameter %d (%s)" % (i + 1, p.name), p.type)
    for name, t in hdr.callbacks.items():
        sig = t.inner
        check_types(name, "callback return value", sig.ret)
        for i, p in enumerate(sig.params):
            check_types(name, "callback parameter %d" % (i + 1), p)

    # Out-parameters come first.
    for f in hdr.functions.values():
        seen_in = None
        for p in f.params:
            if p.name.startswith("out_"):
                if seen_in is not None:
                    bad(f.name, "out-parameter %s comes after input %s; out-parameters come first"
                        % (p.name, seen_in))
                    break
            elif seen_in is None:
                seen_in = p.name

    # Callbacks: user_data is the last parameter, a void pointer.
    for name, t in hdr.callbacks.items():
        sig = t.inner
        names = hdr.callback_params.get(name, [])
        last = sig.params[-1] if sig.params else None
        ok = (last is not None and last.kind == "ptr" and _is_void(last.inner)
              and (not names or names[-1] == "user_data"))
        if not ok:
            bad(name, "callback typedef must take `void *user_data` as its last parameter")
    for f in hdr.functions.values():
        takes_fn = [p for p in f.params if p.type.kind == "ptr" and p.type.inner.kind == "fn"]
        if takes_fn and not any(p.name == "user_data" and p.type.kind == "ptr"
                                and _is_void(p.type.inner) for p in f.params):
            bad(f.name, "takes a callback but no `void *user_data` to pass back to it")

    # create/destroy pairs.
    destroys = {f.name[:-len("_destroy")]: f for f in hdr.functions.values()
                if f.name.endswith("_destroy")}
    produced = set()
    for f in hdr.functions.values():
        for p in f.params:
            t = p.type
            if p.name.startswith("out_") and t.kind == "ptr" and not t.const:
                h = _handle_of(t.inner) if t.inner.kind == "ptr" else None
                if h:
                    produced.add(h)
    for f in hdr.functions.values():
        m = re.match(r"^(rp_\w+?)_create(_\w+)?$", f.name)
        if not m:
            continue
        stem = m.group(1)
        if stem not in destroys:
            bad(f.name, "has no matching %s_destroy" % stem)
        first = f.params[0] if f.params else None
        if (first is None or not first.name.startswith("out_") or first.type.kind != "ptr"
                or first.type.inner.kind != "ptr" or _handle_of(first.type.inner) != stem):
            bad(f.name, "must return the new handle through a first parameter `%s **out_...`" % stem)
    for stem, f in destroys.items():
        h = _handle_of(f.params[0].type) if f.params else None
        if h is not None and h != stem:
            bad(f.name, "destroys %s, but its name says %s" % (h, stem))
        if h is not None and h not in produced:
            bad(f.name, "no function creates %s (no `%s **out_...` parameter anywhere)" % (h, h))
    # A handle the library only lends (rp_layer_call: valid during a callback) is never
    # produced and never owned by the caller, so it needs no destroy; every pointer to it must
    # then be const, so that nothing could pass it where ownership moves.
    mutable_uses = set()

    def note_pointers(t):
        while t is not None and t.kind == "ptr":
            h = _handle_of(t)
            if h is not None and not t.const:
                mutable_uses.add(h)
            t = t.inner

    for f in hdr.functions.values():
        for p in f.params:
            note_pointers(p.type)
    for t in hdr.callbacks.values():
        for p in t.inner.params:
            note_pointers(p)
    for h in sorted(opaque):
        if h in destroys:
            continue
        if h in produced or h in mutable_uses:
            bad(h, "opaque handle has no %s_destroy" % h)

    # rp_status: RP_OK is 0, every error negative.
    st = hdr.enums.get("rp_status")
    if st is None:
        bad("rp_status", "the header declares no rp_status enum")
    else:
        for item, val in st.items:
            if item == "RP_OK" and val != 0:
                bad(item, "RP_OK must be 0")
            if item != "RP_OK" and val >= 0:
                bad(item, "error codes must be negative, got %d" % val)

    # Versioning that every binding relies on.
    for need in ("rp_version", "rp_abi_version", "rp_last_error_message", "rp_status_string"):
        if need not in hdr.functions:
            bad(need, "missing: every binding needs it")
    if "RP_ABI_VERSION" not in hdr.constants:
        bad("RP_ABI_VERSION", "missing macro: bindings compare it with rp_abi_version()")

    # Export macro: SWIG defines RP_API away, so read the text.
    text = _strip_c_comments(hdr.text)
    for f in hdr.functions.values():
        m = re.search(r"(?<![\w])%s\s*\(" % re.escape(f.name), text)
        if not m:
            continue
        start = max(text.rfind(";", 0, m.start()), text.rfind("}", 0, m.start()),
                    text.rfind("*/", 0, m.start()), text.rfind("\n#", 0, m.start()))
        decl = text[start + 1:m.start()]
        if not re.search(r"\bRP_API\b", decl):
            bad(f.name, "declaration lacks the RP_API export macro")
    return problems
