"""Calls of models whose layers pass pytrees (Python layers): the call's inputs flattened for
the engine, the outputs given their structure back.

The first layer, when it is a Python layer, receives every input of the call: any number of
positional and keyword arguments, each any pytree. Their tensor leaves are the engine's inputs
(split into microbatches by the engine's rule, or by the split spec given per argument); the
structure stays here (CallState.input_spec). The model's outputs come back from the engine as
flat tensors per microbatch (merge_output 0) and get the last layer's structure back here.
"""

import contextlib

import torch

from ._callbacks import SplitCall
from ._python_layer import CallState
from ._microbatch import (RoundPipePackedData, _input_dims, is_split_function, merge_default,
                          merge_outputs)
from ._pytree import flatten
from .errors import RoundPipeError, Status


def tree_inputs(args, kwargs, spec):
    """(tensors, per-tensor split dims or None, SplitCall or None, Spec of (args, kwargs))."""
    args, kwargs = tuple(args), dict(kwargs or {})
    tensors, tree = flatten((args, kwargs), entry=True)
    if not tensors:
        raise RoundPipeError(Status.INVALID_ARGUMENT, "the model needs at least one tensor "
                             "among its inputs")
    if spec is None:
        return tensors, None, None, tree
    if is_split_function(spec):
        def flat(a, k):
            pieces, piece_tree = flatten((tuple(a), dict(k or {})), entry=True)
            if piece_tree.num_tensors != tree.num_tensors:
                raise ValueError("a microbatch must have the call's structure: %d tensors, "
                                 "got %d" % (tree.num_tensors, piece_tree.num_tensors))
            return pieces
        return tensors, None, SplitCall(spec, args, kwargs, flat), tree
    # Split specs are given per argument; every tensor leaf of an argument gets its spec.
    values = list(args) + [kwargs[k] for k in kwargs]
    per_arg = _input_dims(spec, args, list(kwargs), len(values))
    dims = []
    for value, dim in zip(values, per_arg):
        dims += [dim] * flatten(value)[1].num_tensors
    return tensors, dims, None, tree


def merge_trees(values):
    """The engine's merge rule applied leaf by leaf to per-microbatch pytrees of one
    structure: tensors with dimensions concatenated along dim 0, 0-d tensors averaged;
    other leaves taken from the first microbatch."""
    flat = [flatten(v) for v in values]
    spec = flat[0][1]
    merged = []
    for i in range(spec.num_tensors):
        leaves = [f[0][i] for f in flat]
        merged.append(torch.stack(leaves).mean(0) if leaves[0].dim() == 0
                      else torch.cat(leaves, 0))
    return spec.unflatten(merged)


def tree_outputs(tensors, state, last_index, num_microbatch, custom, merge):
    """The call's result from the engine's per-microbatch output tensors (merge_output 0):
    each microbatch's outputs rebuilt with the last layer's structure, then merged (`merge`),
    given to the `custom` merge, or returned per microbatch."""
    values, at = [], 0
    for mb in range(num_microbatch):
        spec = state.specs[(mb, last_index)]
        values.append(spec.unflatten(tensors[at:at + spec.num_tensors]))
        at += spec.num_tensors
    if at != len(tensors):
        raise RoundPipeError(Status.INTERNAL, "the engine returned %d output tensors for %d microbatches "
                             "holding %d" % (len(tensors), num_microbatch, at))
    if custom is not None:
        return merge_outputs(values, custom, False)
    if merge:
        return merge_default(values)  # merge_trees' rule, non-tensor leaves checked equal
    return RoundPipePackedData(values)


@contextlib.contextmanager
def layer_call(runtime, layers, scope, input_spec, training, state=None):
    """Around one model call with Python layers: the CallState the layer callbacks use
    (watched by `scope`, which raises the error a layer kept), and the modules in training
    mode for a training call, evaluation mode for forward(), as the engine's own layers run
    (their modes are restored afterwards). Yields the state (None without Python layers)."""
    if runtime is None or not layers:
        yield None
        return
    # `state`: a training forward's, installed again for its later backward (the recompute
    # rebuilds each layer's input structure from it).
    state = state if state is not None else CallState(input_spec, training)
    scope.watch(state)
    modes = [(m, m.training) for layer in layers for m in layer.module.modules()]
    for layer in layers:
        layer.module.train(training)
    runtime.state = state
    try:
        yield state
    finally:
        runtime.state = None
        for m, mode in modes:
            m.training = mode
