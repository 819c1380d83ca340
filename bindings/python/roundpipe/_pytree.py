"""Pytrees across the engine: flatten any Python structure into the flat tensor list the engine
moves between layers, and rebuild it on the other side.

The engine sees only lists of tensors. A structure (tuples, lists, dicts, namedtuples,
dataclasses, the types registered with torch.utils._pytree such as Hugging Face ``ModelOutput``)
is flattened here into its tensor leaves and a :class:`Spec` that holds everything else: the
containers and the non-tensor leaves (ints, None, strings, ...), which stay on the Python side.

The engine accepts a few dtypes at a call's entry (float32/16, bfloat16, int64, int32); a
tensor leaf of another dtype (bool masks, int8, float64) crosses as the nearest accepted dtype
and the spec casts it back (:func:`flatten` with ``entry=True``).
"""

import dataclasses

import torch
import torch.utils._pytree as torch_pytree

_ENTRY_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)


class _Tensor:
    """Spec node: one tensor leaf (cast back to `dtype` when it crossed as another)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype=None):
        self.dtype = dtype


class Spec:
    """The structure of one flattened value: rebuild it with :meth:`unflatten`."""

    __slots__ = ("node", "num_tensors")

    def __init__(self, node, num_tensors):
        self.node = node
        self.num_tensors = num_tensors

    def unflatten(self, tensors):
        tensors = list(tensors)
        if len(tensors) != self.num_tensors:
            raise ValueError("the structure holds %d tensors, got %d"
                             % (self.num_tensors, len(tensors)))
        return _build(self.node, iter(tensors))

    @property
    def is_single_tensor(self):
        """True when the value is one bare tensor."""
        return isinstance(self.node, _Tensor)


def _entry_cast(t):
    """(tensor the engine accepts at a call's entry, dtype to cast back to or None)."""
    if t.dtype in _ENTRY_DTYPES:
        return t, None
    if t.is_floating_point():
        return t.to(torch.float32), t.dtype
    return t.to(torch.int64), t.dtype


def _walk(x, tensors, entry):
    if isinstance(x, torch.Tensor):
        if entry:
            x, back = _entry_cast(x)
        else:
            back = None
        tensors.append(x)
        return _Tensor(back)
    cls = type(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return ("namedtuple", cls, [_walk(v, tensors, entry) for v in x])
    if cls in (tuple, list):
        return (cls.__name__, cls, [_walk(v, tensors, entry) for v in x])
    if cls is dict:
        return ("dict", list(x), [_walk(v, tensors, entry) for v in x.values()])
    node = torch_pytree.SUPPORTED_NODES.get(cls)
    if node is not None:  # OrderedDict, Hugging Face ModelOutput, user registrations
        children, context = node.flatten_fn(x)
        return ("registered", (node, context), [_walk(v, tensors, entry) for v in children])
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x) if f.init]
        return ("dataclass", (x, names),
                [_walk(getattr(x, n), tensors, entry) for n in names])
    return ("leaf", x, None)  # anything else stays on the Python side as it is


def _build(node, tensors):
    if isinstance(node, _Tensor):
        t = next(tensors)
        return t if node.dtype is None else t.to(node.dtype)
    kind, info, children = node
    if kind == "leaf":
        return info
    values = [_build(c, tensors) for c in children]
    if kind == "namedtuple":
        return info(*values)
    if kind in ("tuple", "list"):
        return info(values)
    if kind == "dict":
        return dict(zip(info, values))
    if kind == "registered":
        registered, context = info
        return registered.unflatten_fn(values, context)
    original, names = info  # dataclass: the same object with its fields replaced
    return dataclasses.replace(original, **dict(zip(names, values)))


def flatten(value, entry=False):
    """(tensor leaves in order, Spec). `entry`: the tensors are a call's inputs, cast to the
    dtypes the engine accepts there (the spec casts them back)."""
    tensors = []
    node = _walk(value, tensors, entry)
    return tensors, Spec(node, len(tensors))


def top_level_leaf_counts(values):
    """Number of tensor leaves in each of `values` (for split specs given per argument)."""
    return [flatten(v)[1].num_tensors for v in values]
