"""Read the declarations of the Rust sys crate (bindings/rust/roundpipe-sys/src/lib.rs).

A small tokenizer and recursive-descent reader for the subset of Rust an FFI crate uses:
`pub type`, `pub const`, `#[repr(C)] pub struct`, `extern "C" { pub fn ...; }` (also
`unsafe extern "C"`), raw pointers, `Option<unsafe extern "C" fn(...)>`, `std::os::raw` types.
Everything else (`use`, `impl`, `mod`, functions with bodies) is skipped.
"""

import re

from .abitypes import Policy, any_, fn, prim, ptr, struct
from .binding import BFunc, Binding

RUST_PRIMS = {"i8": "i8", "u8": "u8", "i16": "i16", "u16": "u16", "i32": "i32", "u32": "u32",
              "i64": "i64", "u64": "u64", "isize": "isize", "usize": "usize", "f32": "f32",
              "f64": "f64", "bool": "bool",
              "c_char": "char", "c_schar": "i8", "c_uchar": "u8", "c_short": "i16",
              "c_ushort": "u16", "c_int": "i32", "c_uint": "u32", "c_long": "i64",
              "c_ulong": "u64", "c_longlong": "i64", "c_ulonglong": "u64", "c_float": "f32",
              "c_double": "f64", "c_void": "void"}

POLICY = Policy(check_const=True)

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>b?"(?:\\.|[^"\\])*")
  | (?P<chr>'(?:\\.|[^'\\])')
  | (?P<num>0x[0-9a-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[iu](?:8|16|32|64|size))?)
  | (?P<id>[A-Za-z_]\w*)
  | (?P<op>::|->|=>|[-+*/&|!<>=(){}\[\];:,.#?])
""", re.X)


def _strip_comments(text):
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 0, i
            while j < n:
                if text.startswith("/*", j):
                    depth += 1
                    j += 2
                elif text.startswith("*/", j):
                    depth -= 1
                    j += 2
                    if depth == 0:
                        break
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text[i] == '"':
            m = re.compile(r'"(?:\\.|[^"\\])*"', re.S).match(text, i)
            j = m.end() if m else n
            out.append(text[i:j])
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def tokenize(text):
    text = _strip_comments(text)
    toks, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            toks.append(("op", text[pos], line))
            pos += 1
            continue
        kind = m.lastgroup
        val = m.group(kind)
        if kind != "ws":
            toks.append((kind, val, line))
        line += val.count("\n")
        pos = m.end()
    return toks


class _Reader:
    def __init__(self, toks):
        self.toks = toks
        self.i = 0

    def peek(self, k=0):
        j = self.i + k
        return self.toks[j][1] if j < len(self.toks) else None

    def line(self):
        return self.toks[self.i][2] if self.i < len(self.toks) else 0

    def next(self):
        t = self.toks[self.i][1]
        self.i += 1
        return t

    def expect(self, val):
        got = self.next()
        if got != val:
            raise SyntaxError("expected %r, got %r at line %d" % (val, got, self.toks[self.i - 1][2]))

    def skip_balanced(self):
        """Skip one token, or a whole bracketed group when it opens one."""
        pairs = {"(": ")", "[": "]", "{": "}"}
        t = self.next()
        if t not in pairs:
            return
        depth = 1
        while depth and self.i < len(self.toks):
            u = self.next()
            if u in pairs:
                depth += 1
            elif u in pairs.values():
                depth -= 1

    def skip_to(self, *ends):
        while self.i < len(self.toks) and self.peek() not in ends:
            self.skip_balanced()
        if self.i < len(self.toks):
            self.next()

    # Types, as nested tuples resolved later (aliases may come after their use).
    def type_(self):
        t = self.peek()
        if t == "*":
            self.next()
            q = self.next()
            if q not in ("mut", "const"):
                raise SyntaxError("raw pointer without mut/const at line %d" % self.line())
            return ("ptr", q == "const", self.type_())
        if t == "&":
            self.next()
            const = True
            if self.peek() == "mut":
                self.next()
                const = False
            return ("ptr", const, self.type_())
        if t == "(":
            self.next()
            self.expect(")")
            return ("name", "()")
        if t == "[":
            self.skip_balanced()
            return ("unknown", "array")
        if t in ("unsafe", "extern", "fn"):
            if self.peek() == "unsafe":
                self.next()
            if self.peek() == "extern":
                self.next()
                if self.peek() and self.peek().startswith('"'):
                    self.next()
            self.expect("fn")
            params = self.params()
            ret = ("name", "()")
            if self.peek() == "->":
                self.next()
                ret = self.type_()
            return ("fnptr", ret, [p[1] for p in params])
        # A path, possibly generic.
        segs = [self.next()]
        while self.peek() == "::":
            self.next()
            segs.append(self.next())
        args = []
        if self.peek() == "<":
            self.next()
            while self.peek() != ">":
                args.append(self.type_())
                if self.peek() == ",":
                    self.next()
            self.expect(">")
        return ("name", segs[-1], args)

    def params(self):
        """`( name: Type, ... )` or `( Type, ... )`, returned as [(name or None, type)]."""
        self.expect("(")
        out = []
        while self.peek() != ")":
            name = None
            if self.peek(1) == ":" and self.peek(2) != ":":
                name = self.next()
                self.next()
            out.append((name, self.type_()))
            if self.peek() == ",":
                self.next()
        self.expect(")")
        return out


def _resolve(node, aliases, structs, depth=0):
    if depth > 40:
        return any_("alias cycle")
    kind = node[0]
    if kind == "ptr":
        return ptr(_resolve(node[2], aliases, structs, depth + 1), const=node[1])
    if kind == "fnptr":
        ret = _resolve(node[1], aliases, structs, depth + 1)
        return ptr(fn(ret, [_resolve(p, aliases, structs, depth + 1) for p in node[2]]))
    if kind == "unknown":
        return any_(node[1])
    name = node[1]
    args = node[2] if len(node) > 2 else []
    if name == "()":
        return prim("void")
    if name == "Option" and len(args) == 1:  # nullable function pointer or NonNull
        return _resolve(args[0], aliases, structs, depth + 1)
    if name == "NonNull" and len(args) == 1:
        return ptr(_resolve(args[0], aliases, structs, depth + 1))
    if name in RUST_PRIMS:
        return prim(RUST_PRIMS[name])
    if name in aliases:
        return _resolve(aliases[name], aliases, structs, depth + 1)
    if name in structs:
        return struct(name)
    return any_("unknown Rust type %s" % name)


def _const_value(toks):
    """Integer value of `-1`, `0x10`, `1 as c_int`, `-7i32`, else None."""
    vals = [t for t in toks]
    if "as" in vals:
        vals = vals[:vals.index("as")]
    s = "".join(vals).replace("_", "")
    s = re.sub(r"[iu](8|16|32|64|size)$", "", s)
    s = s.strip("()")
    try:
        return int(s, 0)
    except ValueError:
        return None


def _extern_block_at(r):
    k = 1 if r.peek() == "unsafe" else 0
    return (r.peek(k) == "extern" and (r.peek(k + 1) or "").startswith('"')
            and r.peek(k + 2) == "{")


def parse_rust(path, name="rust"):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    b = Binding(name=name, path=path, policy=POLICY, require_structs=True,
                require_constants=True, require_callbacks=True,
                abi_constant="RP_ABI_VERSION")
    r = _Reader(tokenize(text))
    aliases, raw_structs, raw_fns, raw_consts = {}, {}, [], []
    opaque = set()

    def item(in_extern):
        line = r.line()
        t = r.peek()
        if t == "#":
            r.next()
            if r.peek() == "!":
                r.next()
            r.skip_balanced()
            return
        if t == "pub":
            r.next()
            if r.peek() == "(":  # pub(crate)
                r.skip_balanced()
            t = r.peek()
        if t == "type":
            r.next()
            nm = r.next()
            r.expect("=")
            aliases[nm] = r.type_()
            r.expect(";")
            if nm.startswith("rp_") and nm.endswith("_fn"):
                b.callbacks.setdefault(nm, (None, line))
        elif t == "const" and r.peek(1) != "fn":
            r.next()
            nm = r.next()
            r.expect(":")
            r.type_()
            r.expect("=")
            vals = []
            while r.peek() != ";":
                vals.append(r.next())
            r.next()
            raw_consts.append((nm, vals, line))
        elif t == "struct":
            r.next()
            nm = r.next()
            fields = []
            if r.peek() == "{":
                r.next()
                while r.peek() != "}":
                    if r.peek() == "#":
                        r.next()
                        r.skip_balanced()
                        continue
                    if r.peek() == "pub":
                        r.next()
                        if r.peek() == "(":
                            r.skip_balanced()
                    fname = r.next()
                    r.expect(":")
                    fields.append((fname, r.type_()))
                    if r.peek() == ",":
                        r.next()
                r.next()
            else:
                r.skip_to(";")
            raw_structs[nm] = (fields, line)
            if not fields or all(f[0].startswith("_") for f in fields):
                opaque.add(nm)
        elif not in_extern and _extern_block_at(r):
            if r.peek() == "unsafe":
                r.next()
            r.next()  # extern
            abi = r.next()
            r.next()  # {
            while r.peek() != "}":
                if abi != '"C"':
                    r.skip_balanced()
                    continue
                item(True)
            r.next()
        elif t in ("fn", "unsafe", "safe") and in_extern:
            if t in ("unsafe", "safe"):
                r.next()
            r.expect("fn")
            nm = r.next()
            params = r.params()
            ret = ("name", "()")
            if r.peek() == "->":
                r.next()
                ret = r.type_()
            r.expect(";")
            raw_fns.append((nm, params, ret, line))
        elif t == "static" and in_extern:
            r.skip_to(";")
        elif t in ("use", "mod", "impl", "fn", "const", "unsafe", "extern", "static", "enum",
                   "trait", "macro_rules"):
            # Declarations with a body or ending in ';' that the gate does not read.
            while r.peek() not in (";", "{"):
                r.skip_balanced()
            r.skip_balanced()
        else:
            r.skip_balanced()

    try:
        while r.i < len(r.toks):
            item(False)
    except (SyntaxError, IndexError, TypeError, AttributeError) as e:
        b.problems.append(("(parse)", "could not read %s: %s" % (path, e), r.line()))
        return b

    structs = set(raw_structs)
    for nm, (fields, line) in raw_structs.items():
        if nm in opaque:
            continue
        b.structs[nm] = [(fname, _resolve(ft, aliases, structs)) for fname, ft in fields]
        b.struct_lines[nm] = line
    for nm, (_, line) in list(b.callbacks.items()):
        b.callbacks[nm] = (_resolve(aliases[nm], aliases, structs), line)
    for nm, params, ret, line in raw_fns:
        bf = BFunc(nm, _resolve(ret, aliases, structs),
                   [_resolve(p[1], aliases, structs) for p in params],
                   [p[0] for p in params], line)
        b.add_function(bf)
    for nm, vals, line in raw_consts:
        v = _const_value(vals)
        if v is not None:
            b.constants[nm] = (v, line)
    return b
