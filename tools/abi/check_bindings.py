#!/usr/bin/env python3
"""RoundPipe's header gate: keep include/roundpipe.h conventional and every binding true to it.

    python3 tools/abi/check_bindings.py            # from any folder; exit 0 when all agree

1. `swig -xml` (SWIG 4.x, through tools/abi/roundpipe.i) dumps every declaration of the header.
2. The header's conventions are checked: rp_ prefixes, rp_status returns for fallible calls (void
   only for rp_*_destroy), create/destroy pairs, out-parameters first, `void *user_data` last in
   callback typedefs, no struct passed by value, RP_API on every function, versioning present.
3. Each binding is read without running it and compared with the header: every function
   declared, the same number of parameters, compatible types, nothing the header lacks; struct
   layouts, callback types and constant values where the binding declares them.
     python  bindings/python/roundpipe/_capi.py            (ctypes, read with ast)
     julia   bindings/julia/RoundPipe.jl/src/LibRoundPipe.jl (ccall, read as text)
     rust    bindings/rust/roundpipe-sys/src/lib.rs        (extern "C", read as tokens)
   Each binding's ABI version constant (Python ABI_VERSION, Julia and Rust RP_ABI_VERSION) must
   equal the header's RP_ABI_VERSION, the one source of the ABI version.

Every problem is printed as `<binding>: <function or type>: <difference> [file:line]`.
Exit status: 0 all agree, 1 a convention or a binding disagrees, 2 the gate could not run.
Standard library only.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from abigate.binding import compare  # noqa: E402
from abigate.conventions import check_conventions  # noqa: E402
from abigate.header import GateError, parse_header  # noqa: E402
from abigate.julia import parse_julia  # noqa: E402
from abigate.pyctypes import parse_python  # noqa: E402
from abigate.rust import parse_rust  # noqa: E402

REPO = os.path.normpath(os.path.join(HERE, "..", ".."))

BINDINGS = {
    "python": os.path.join("bindings", "python", "roundpipe", "_capi.py"),
    "julia": os.path.join("bindings", "julia", "RoundPipe.jl", "src", "LibRoundPipe.jl"),
    "rust": os.path.join("bindings", "rust", "roundpipe-sys", "src", "lib.rs"),
}


def _rel(path):
    try:
        rel = os.path.relpath(path, REPO)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _fmt(binding, subject, msg, path, line):
    where = "%s:%d" % (_rel(path), line) if line else _rel(path)
    return "%s: %s: %s [%s]" % (binding, subject, msg, where)


def run(header, paths, swig="swig", out=sys.stdout, err=sys.stderr, verbose=False):
    """Run the gate; returns the exit status. `paths` maps binding name -> file."""
    try:
        hdr = parse_header(header, swig=swig)
    except GateError as e:
        print("header: %s" % e, file=err)
        return 2

    errors, warnings = [], []
    for subject, msg in check_conventions(hdr):
        line = hdr.line_of(subject)
        errors.append(_fmt("header", subject, msg, header, line))

    counts = {}
    for name, path in paths.items():
        if not os.path.isfile(path):
            errors.append(_fmt(name, "(binding)", "missing file: %s does not exist" % _rel(path),
                               path, 0))
            continue
        if name == "python":
            b = parse_python(path, hdr)
        elif name == "julia":
            b = parse_julia(path)
        else:
            b = parse_rust(path)
        counts[name] = len(b.functions)
        for subject, msg, line in compare(hdr, b):
            errors.append(_fmt(name, subject, msg, path, line))
        for subject, msg, line in getattr(b, "warnings", []):
            warnings.append(_fmt(name, subject, msg, path, line))

    for w in warnings:
        print("warning: " + w, file=err)
    for e in errors:
        print(e, file=err)
    summary = "header %s: %d functions, %d callback types, %d structs, %d constants" % (
        _rel(header), len(hdr.functions), len(hdr.callbacks), len(hdr.structs),
        len(hdr.constants))
    if verbose or not errors:
        print(summary, file=out)
        for name in paths:
            if name in counts:
                print("  %-6s %3d functions  %s" % (name, counts[name], _rel(paths[name])),
                      file=out)
    if errors:
        print("header gate: %d problem(s)" % len(errors), file=err)
        return 1
    print("header gate: OK", file=out)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--header", default=os.path.join(REPO, "include", "roundpipe.h"),
                    help="the C header (default: include/roundpipe.h)")
    ap.add_argument("--swig", default=os.environ.get("SWIG", "swig"),
                    help="swig executable (default: $SWIG or swig)")
    for name, rel in BINDINGS.items():
        ap.add_argument("--" + name, metavar="FILE", default=os.path.join(REPO, rel),
                        help="%s binding declarations (default: %s)" % (name, rel))
    ap.add_argument("--only", metavar="LIST",
                    help="comma-separated bindings to check (default: all: %s)"
                    % ",".join(BINDINGS))
    ap.add_argument("-v", "--verbose", action="store_true", help="print the summary always")
    args = ap.parse_args(argv)

    names = list(BINDINGS)
    if args.only is not None:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BINDINGS]
        if unknown:
            ap.error("unknown binding(s): %s" % ", ".join(unknown))
    paths = {n: os.path.abspath(getattr(args, n)) for n in names}
    return run(os.path.abspath(args.header), paths, swig=args.swig, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
