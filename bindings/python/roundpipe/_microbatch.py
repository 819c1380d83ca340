"""The Python side of one call's microbatches: what only Python can see.

The engine splits tensors and merges outputs by its own rules (``rp_split_microbatches``, the
default merge, the split dims of a run configuration). What stays here is what the engine
cannot see: the structure of a Python call (positional and keyword arguments, Python scalars),
upstream's split specs over that structure, pytrees of labels for a Python loss_fn (walked
here, every tensor leaf split by the engine), and the merges the engine does not do
(functions, reducers, TensorChunkSpec along another dimension than 0).
"""

import functools

import torch

from ._callbacks import SplitCall
from ._internals import split_microbatches
from .config import _is_chunk_spec, _is_reducer, _is_replicate, leaf_split_dim
from .errors import RoundPipeError, Status


class RoundPipePackedData(list):
    """Per-microbatch outputs (``merge_output=False``). A list; ``synchronize()`` is there for
    upstream compatibility and does nothing (outputs are complete when the call returns)."""

    def synchronize(self):
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


def merge_outputs(tensors, custom, merged_by_engine):
    """A call's result from the engine's output tensors: the engine's merge (`merged_by_engine`:
    the resolved merge_output was 1), per-microbatch outputs as RoundPipePackedData, or the
    `custom` merge (config.is_custom_merge) applied to the per-microbatch outputs."""
    if custom is None:
        if merged_by_engine:
            return tensors[0] if len(tensors) == 1 else tensors
        return RoundPipePackedData(tensors)
    if _is_reducer(custom):
        return functools.reduce(custom.reduce_fn, tensors, custom.init_value)
    if _is_chunk_spec(custom):
        return torch.cat(tensors, dim=custom.split_dim)
    if callable(custom):
        return custom(tensors)
    raise TypeError("merge_output must be None, a bool, TensorChunkSpec, _CustomReducer or a "
                    "function; got %r" % (custom,))
