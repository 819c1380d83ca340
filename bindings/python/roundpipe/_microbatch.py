"""The Python side of one call's microbatches: what only Python can see.

The engine splits tensors and merges outputs by its own rules (``rp_split_microbatches``, the
default merge, the split dims of a run configuration). What stays here is what the engine
cannot see: the structure of a Python call (positional and keyword arguments, Python scalars),
upstream's split specs over that structure, pytrees of labels for a Python loss_fn (walked
here, every tensor leaf split by the engine), and the merges the engine does not do
(functions, reducers, TensorChunkSpec along another dimension than 0).
"""

import copy
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._callbacks import SplitCall
from ._internals import split_microbatches
from ._pytree import flatten as tree_flatten
from .config import RoundPipeRunConfig, _is_chunk_spec, _is_reducer, _is_replicate, \
    leaf_split_dim
from .errors import RoundPipeError, Status


class RoundPipePackedData(list):
    """One leaf of a ``merge_output=False`` output: its value in every microbatch, in order (a
    list). Give it (or a structure holding several) to another RoundPipe model as an input and
    microbatch m of that call gets element m, unsplit: the call runs with as many microbatches
    as the packed data holds. ``synchronize()`` is there for upstream compatibility and returns
    at once (outputs are complete when the call that made them returns)."""

    def synchronize(self) -> "RoundPipePackedData":
        return self


def is_split_function(spec):
    """A user split function (not a leaf spec that happens to be callable)."""
    return spec is not None and callable(spec) and not _is_chunk_spec(spec) \
        and not _is_replicate(spec)


def _as_input(x, where):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (bool, int, float)):
        return torch.tensor(x)
    raise TypeError("%s: inputs must be tensors or Python numbers, got %s"
                    % (where, type(x).__name__))


def call_inputs(args, kwargs, spec):
    """(tensors, per-input split dims or None, SplitCall or None) of a call's positional and
    keyword arguments under the split_input `spec`."""
    args = tuple(args)
    kwargs = dict(kwargs or {})
    keys = list(kwargs)

    def flatten(a, k):
        a = tuple(a)
        k = dict(k or {})
        if len(a) != len(args) or list(k) != keys:
            raise ValueError("a microbatch must have the call's structure: %d positional "
                             "arguments and keywords %s" % (len(args), keys))
        return [_as_input(x, "argument %d" % i) for i, x in enumerate(a)] + \
            [_as_input(k[key], "keyword %r" % key) for key in keys]

    tensors = flatten(args, kwargs)
    if not tensors:
        raise RoundPipeError(Status.INVALID_ARGUMENT, "the model needs at least one input")
    if spec is None:
        return tensors, None, None
    if is_split_function(spec):
        return tensors, None, SplitCall(spec, args, kwargs, flatten)
    return tensors, _input_dims(spec, args, keys, len(tensors)), None


def _input_dims(spec, args, keys, n_tensors):
    """Per-input split dims of a leaf spec, a flat list of leaves, or (args_spec,
    kwargs_spec)."""
    if (isinstance(spec, (tuple, list)) and len(spec) == 2
            and (spec[0] is None or isinstance(spec[0], (tuple, list)))
            and (spec[1] is None or isinstance(spec[1], dict))):
        args_spec = tuple(spec[0]) if spec[0] is not None else (None,) * len(args)
        kwargs_spec = spec[1] or {}
        if len(args_spec) != len(args):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "split_input has %d args specs for "
                                 "%d positional arguments" % (len(args_spec), len(args)))
        unknown = set(kwargs_spec) - set(keys)
        if unknown:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "split_input names keywords the "
                                 "call does not have: %s" % sorted(unknown))
        dims = [leaf_split_dim(s, "split_input args[%d]" % i) for i, s in enumerate(args_spec)]
        return dims + [leaf_split_dim(kwargs_spec.get(k), "split_input kwargs[%r]" % k)
                       for k in keys]
    if isinstance(spec, (tuple, list)):
        if len(spec) != n_tensors:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "split_input has %d specs for %d "
                                 "inputs" % (len(spec), n_tensors))
        return [leaf_split_dim(s, "split_input[%d]" % i) for i, s in enumerate(spec)]
    return [leaf_split_dim(spec, "split_input")] * n_tensors


def builtin_label_dim(spec):
    """The label split dim for a built-in loss (the engine splits its one label tensor)."""
    if is_split_function(spec):
        raise TypeError("a split_label function needs a Python loss_fn")
    return leaf_split_dim(spec, "split_label")


def split_label(label, spec, n):
    """Per-microbatch labels for a Python loss_fn, after upstream's rules: a split function, or
    the pytree of `label` walked with the matching `spec`, each tensor leaf split by the
    engine's rule, other leaves given whole to every microbatch."""
    if is_split_function(spec):
        pieces = list(spec(label, n))
        if len(pieces) != n:
            raise ValueError("split_label function returned %d pieces for %d microbatches"
                             % (len(pieces), n))
        return pieces
    if isinstance(label, torch.Tensor):
        if isinstance(spec, (tuple, list, dict)):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "split_label %r is nested but the "
                                 "label is one tensor" % (spec,))
        dim = leaf_split_dim(spec, "split_label")
        return split_microbatches(label, 0 if dim is None else dim, n)
    if isinstance(label, (tuple, list)):
        specs = spec if isinstance(spec, (tuple, list)) else [spec] * len(label)
        if len(specs) != len(label):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "split_label spec has %d entries "
                                 "for a label of %d" % (len(specs), len(label)))
        columns = [split_label(x, s, n) for x, s in zip(label, specs)]
        return [type(label)(col[m] for col in columns) if isinstance(label, tuple) else
                [col[m] for col in columns] for m in range(n)]
    if isinstance(label, dict):
        specs = spec if isinstance(spec, dict) else {k: spec for k in label}
        columns = {k: split_label(v, specs.get(k), n) for k, v in label.items()}
        return [{k: columns[k][m] for k in label} for m in range(n)]
    return [label] * n  # None and other objects go whole to every microbatch


def merge_outputs(tensors: List[Any], custom: Any, merged_by_engine: bool) -> Any:
    """A call's result from the engine's output tensors: the engine's merge (`merged_by_engine`:
    the resolved merge_output was 1), per-microbatch outputs as RoundPipePackedData, or the
    `custom` merge (config.is_custom_merge) applied to the per-microbatch outputs."""
    if custom is None:
        if merged_by_engine:
            return tensors[0] if len(tensors) == 1 else tensors
        return RoundPipePackedData(tensors)
    return merge_by_spec(list(tensors), custom, "merge_output")


def merge_by_spec(values: List[Any], spec: Any, where: str) -> Any:
    """Merge per-microbatch `values` after upstream's merge spec `spec`: a function of the
    list, a _CustomReducer, TensorChunkSpec(dim), _Replicate (all equal), None / True (the
    default rule), False (a RoundPipePackedData per leaf), or a tuple / list / dict of these
    matching the values' structure. Errors name `where` (the spec's path)."""
    if spec is None or spec is True:
        return merge_default(values, where)
    if spec is False:
        return pack_leaves(values)
    if _is_reducer(spec):
        return functools.reduce(spec.reduce_fn, values, spec.init_value)
    if _is_chunk_spec(spec):
        if not all(isinstance(v, torch.Tensor) and v.dim() > spec.split_dim for v in values):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "%s: TensorChunkSpec(%d) needs a "
                                 "tensor with dimension %d, the output there is %s"
                                 % (where, spec.split_dim, spec.split_dim, _describe(values[0])))
        return torch.cat(values, dim=spec.split_dim)
    if _is_replicate(spec):
        return _same(values, where)
    if isinstance(spec, (tuple, list)):
        first = values[0]
        if not isinstance(first, (tuple, list)) or len(first) != len(spec):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "%s is a %s of %d specs, the output "
                                 "there is %s" % (where, type(spec).__name__, len(spec),
                                                  _describe(first)))
        merged = [merge_by_spec([v[i] for v in values], s, "%s[%d]" % (where, i))
                  for i, s in enumerate(spec)]
        return _rebuild_sequence(first, merged)
    if isinstance(spec, dict):
        first = values[0]
        if not hasattr(first, "keys") or set(spec) - set(first.keys()):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "%s names keys %s, the output there "
                                 "is %s" % (where, sorted(map(str, spec)), _describe(first)))
        merged = {k: merge_by_spec([v[k] for v in values], spec.get(k), "%s[%r]" % (where, k))
                  for k in first.keys()}
        return merged if type(first) is dict else type(first)(**merged)
    if callable(spec):
        return spec(values)
    raise RoundPipeError(Status.INVALID_ARGUMENT, "%s must be None, a bool, TensorChunkSpec, "
                         "_Replicate, _CustomReducer, a function, or a tuple / list / dict of "
                         "these; got %r" % (where, spec))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor of shape %s" % (tuple(value.shape),)
    if isinstance(value, (tuple, list)):
        return "a %s of %d" % (type(value).__name__, len(value))
    return "a %s" % type(value).__name__


def _rebuild_sequence(like: Any, items: List[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    if type(like) in (tuple, list):
        return type(like)(items)
    return list(items)


def _same_structure(a: Any, b: Any) -> bool:
    """Whether two pytrees match outside their tensors: containers, keys, registered types'
    contexts and non-tensor leaves (compared with ==)."""
    def walk(x: Any, y: Any) -> bool:
        if isinstance(x, tuple) and isinstance(y, tuple) and len(x) == 3 and len(y) == 3:
            kind, info, children = x
            if kind != y[0]:
                return False
            if kind == "registered":
                if info[0] is not y[1][0] or not _truthy(info[1], y[1][1]):
                    return False
            elif kind == "leaf":
                return _truthy(info, y[1])
            elif kind == "dataclass":
                if type(info[0]) is not type(y[1][0]) or info[1] != y[1][1]:
                    return False
            elif info != y[1]:
                return False
            return len(children) == len(y[2]) and all(walk(c, d) for c, d in zip(children,
                                                                                 y[2]))
        return type(x) is type(y)  # tensor nodes
    return walk(tree_flatten(a)[1].node, tree_flatten(b)[1].node)


def _truthy(x: Any, y: Any) -> bool:
    try:
        return x is y or bool(x == y)
    except Exception:  # noqa: BLE001 - a type whose == is not a truth value
        return False


def _equal(a: Any, b: Any) -> bool:
    """Equal values: tensors by shape and contents, structures leaf by leaf (context too)."""
    ta, tb = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(ta) != len(tb) or any(x.shape != y.shape or not torch.equal(x, y)
                                 for x, y in zip(ta, tb)):
        return False
    return _same_structure(a, b)


def _same(values: List[Any], where: str) -> Any:
    first = values[0]
    for m, v in enumerate(values[1:], 1):
        if not _equal(first, v):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "%s: microbatch %d's output differs "
                                 "from microbatch 0's, and the merge spec says every "
                                 "microbatch gives the same value" % (where, m))
    return first


def merge_default(values: List[Any], where: str = "merge_output") -> Any:
    """Upstream's default merge of per-microbatch pytrees: tensors with dimensions
    concatenated along dim 0, 0-d tensors averaged, other leaves checked equal."""
    flat = [tree_flatten(v) for v in values]
    spec = flat[0][1]
    for m, (_, s) in enumerate(flat[1:], 1):
        if s.num_tensors != spec.num_tensors:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "%s: microbatch %d's output has %d "
                                 "tensors, microbatch 0's %d" % (where, m, s.num_tensors,
                                                                 spec.num_tensors))
    for m, v in enumerate(values[1:], 1):
        if not _same_structure(values[0], v):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "%s: microbatch %d's output differs "
                                 "from microbatch 0's in a value that is not a tensor (upstream's "
                                 "merge checks them equal)" % (where, m))
    merged = []
    for i in range(spec.num_tensors):
        leaves = [f[0][i] for f in flat]
        merged.append(torch.stack(leaves).mean(0) if leaves[0].dim() == 0
                      else torch.cat(leaves, 0))
    return spec.unflatten(merged)


# -- merge_output=False and chaining -------------------------------------------------------------


def pack_leaves(values: Sequence[Any]) -> Any:
    """Per-microbatch outputs -> the structure of microbatch 0 with every leaf a
    RoundPipePackedData of that leaf's value in each microbatch (upstream's merge_output=False).
    Tuples, lists, dicts and namedtuples are walked; other values are leaves."""
    first = values[0]
    if isinstance(first, (tuple, list)) and not isinstance(first, RoundPipePackedData) and \
            (type(first) in (tuple, list) or hasattr(first, "_fields")) and \
            all(type(v) is type(first) and len(v) == len(first) for v in values):
        return _rebuild_sequence(first, [pack_leaves([v[i] for v in values])
                                         for i in range(len(first))])
    if type(first) is dict and all(type(v) is dict and list(v) == list(first) for v in values):
        return {k: pack_leaves([v[k] for v in values]) for k in first}
    return RoundPipePackedData(values)


def _find_packed(value: Any, found: List[RoundPipePackedData]) -> None:
    if isinstance(value, RoundPipePackedData):
        found.append(value)
    elif type(value) in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        for v in value:
            _find_packed(v, found)
    elif type(value) is dict:
        for v in value.values():
            _find_packed(v, found)


def packed_requiring_grad(args: Any, kwargs: Any) -> bool:
    """Whether a RoundPipePackedData among the inputs holds a tensor that requires grad."""
    found: List[RoundPipePackedData] = []
    _find_packed((tuple(args), dict(kwargs or {})), found)
    return any(t.requires_grad for p in found for v in p for t in tree_flatten(v)[0])


def any_requiring_grad(args: Any, kwargs: Any) -> bool:
    """Whether any tensor among the inputs (packed or not, at any depth) requires grad."""
    if packed_requiring_grad(args, kwargs):
        return True
    leaves = tree_flatten((tuple(args), dict(kwargs or {})))[0]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def _select(value: Any, m: int, n: int, dim: Optional[int]) -> Any:
    """Microbatch m of `value`: a RoundPipePackedData's element m, containers walked, other
    tensors split by the engine's rule along `dim` (None: 0), other leaves whole."""
    if isinstance(value, RoundPipePackedData):
        return value[m]
    if type(value) in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return _rebuild_sequence(value, [_select(v, m, n, dim) for v in value])
    if type(value) is dict:
        return {k: _select(v, m, n, dim) for k, v in value.items()}
    tensors, spec = tree_flatten(value)
    if not tensors:
        return value
    split_dim = 0 if dim is None else dim
    pieces = [split_microbatches(t, split_dim, n)[m] if t.dim() > 0 else t for t in tensors]
    return spec.unflatten(pieces)


def _joined(value: Any) -> Any:
    """`value` with every RoundPipePackedData merged (the call's nominal whole input)."""
    if isinstance(value, RoundPipePackedData):
        return merge_default(list(value), "input")
    if type(value) in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return _rebuild_sequence(value, [_joined(v) for v in value])
    if type(value) is dict:
        return {k: _joined(v) for k, v in value.items()}
    return value


def chained_call(args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]],
                 call_config: Optional[RoundPipeRunConfig],
                 model_config: RoundPipeRunConfig
                 ) -> Tuple[Tuple[Any, ...], Optional[Dict[str, Any]],
                            Optional[RoundPipeRunConfig]]:
    """A call whose inputs hold RoundPipePackedData (another model's merge_output=False
    output), rewritten so that microbatch m gets element m of each: (args, kwargs, run config)
    with a split_input function doing that (other inputs split by the spec given, else by the
    engine's rule) and num_microbatch the packed length. Calls without packed data come back
    unchanged. A split_input function of the user's gets the packed data as it is."""
    args = tuple(args)
    kwargs = dict(kwargs or {})
    found: List[RoundPipePackedData] = []
    _find_packed((args, kwargs), found)
    if not found:
        return args, kwargs, call_config
    n = len(found[0])
    if n == 0 or any(len(p) != n for p in found):
        raise RoundPipeError(Status.INVALID_ARGUMENT, "input: the RoundPipePackedData inputs "
                             "hold %s microbatches; they must all hold the same number (>= 1)"
                             % sorted({len(p) for p in found}))
    for p in found:
        p.synchronize()

    def pick(field: str) -> Any:
        value = getattr(call_config, field) if call_config is not None else None
        return value if value is not None else getattr(model_config, field)

    wanted = pick("num_microbatch")
    if wanted is not None and wanted != n:
        raise RoundPipeError(Status.INVALID_ARGUMENT, "num_microbatch is %d but the "
                             "RoundPipePackedData input holds %d microbatches" % (wanted, n))
    spec = pick("split_input")
    if spec is not None and callable(spec) and not _is_chunk_spec(spec) \
            and not _is_replicate(spec):
        user = spec

        def split(_a: Tuple[Any, ...], _k: Dict[str, Any], num: int) -> Any:
            return user(args, kwargs, num)
    else:
        arg_dims, kw_dims = _per_argument_dims(spec, args, kwargs)

        def split(_a: Tuple[Any, ...], _k: Dict[str, Any], num: int) -> Any:
            return ([tuple(_select(a, m, num, d) for a, d in zip(args, arg_dims))
                     for m in range(num)],
                    [{k: _select(v, m, num, kw_dims[k]) for k, v in kwargs.items()}
                     for m in range(num)])
    config = copy.copy(call_config) if call_config is not None else RoundPipeRunConfig()
    config.split_input = split
    config.num_microbatch = n
    return _joined(args), _joined(kwargs), config


def _per_argument_dims(spec: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                       ) -> Tuple[List[Optional[int]], Dict[str, Optional[int]]]:
    """Split dims per positional argument and keyword for inputs beside packed data:
    (args_spec, kwargs_spec) of leaf specs, one leaf spec for all, or None."""
    if spec is None:
        return [None] * len(args), {k: None for k in kwargs}
    if (isinstance(spec, (tuple, list)) and len(spec) == 2
            and (spec[0] is None or isinstance(spec[0], (tuple, list)))
            and (spec[1] is None or isinstance(spec[1], dict))):
        a_spec = list(spec[0]) if spec[0] is not None else [None] * len(args)
        k_spec = spec[1] or {}
        if len(a_spec) != len(args):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "split_input has %d args specs for "
                                 "%d positional arguments" % (len(a_spec), len(args)))
        dims = [leaf_split_dim(s, "split_input args[%d]" % i) for i, s in enumerate(a_spec)]
        return dims, {k: leaf_split_dim(k_spec.get(k), "split_input kwargs[%r]" % k)
                      for k in kwargs}
    dim = leaf_split_dim(spec, "split_input")
    return [dim] * len(args), {k: dim for k in kwargs}
