"""Data saved in a forward for its recompute (upstream's recompute_data page), inside Python
layers.

A training call runs each Python layer's forward twice for most microbatches: once in a forward
stage (no gradient) and again when its backward stage recomputes it (with gradient). What the
first run saves with :func:`save_for_recompute` the second run gets from
:func:`get_recompute_data`, keyed by (microbatch, layer) in the call's state. The layer callback
sets the thread's current layer run (:func:`_running`) around the module's forward.
"""

import contextlib
import threading

import torch

__all__ = ["doing_recompute", "save_for_recompute", "get_recompute_data"]

_local = threading.local()


class _Run:
    """One run of one Python layer: where its saved data goes and comes from."""

    __slots__ = ("store", "key", "recording", "recomputing", "saved", "data")

    def __init__(self, store, key, recording, recomputing):
        self.store = store  # dict of the call: (microbatch, layer) -> tuple
        self.key = key
        self.recording = recording  # a forward stage whose recompute will follow
        self.recomputing = recomputing
        self.saved = False
        self.data = None  # what the recompute took from the store (freed there)


@contextlib.contextmanager
def _running(run):
    previous = getattr(_local, "run", None)
    _local.run = run
    try:
        yield
    finally:
        _local.run = previous


def doing_recompute():
    """True while a Python layer's forward is being recomputed for its backward."""
    run = getattr(_local, "run", None)
    return run is not None and run.recomputing


def save_for_recompute(*data):
    """Save `data` in a forward, for :func:`get_recompute_data` in its recompute. At most once
    per layer forward; tensors must not require gradients. A no-op where no recompute follows
    (inference, the fused tail stage, outside a RoundPipe layer)."""
    run = getattr(_local, "run", None)
    if run is None or not run.recording:
        return
    assert not run.saved, "save_for_recompute may be called at most once per layer forward"
    for item in data:
        assert not (isinstance(item, torch.Tensor) and item.requires_grad), \
            "save_for_recompute: saved tensors must not require gradients"
    # Clones: a tensor may be a view of memory the engine lends only for this callback.
    run.store[run.key] = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x
                               for x in data)
    run.saved = True


def get_recompute_data():
    """The tuple the forward saved with :func:`save_for_recompute` (only while recomputing)."""
    run = getattr(_local, "run", None)
    assert run is not None and run.recomputing, \
        "get_recompute_data can only be called during recomputation"
    if run.data is None:
        assert run.key in run.store, \
            "the forward of this layer saved nothing (save_for_recompute)"
        run.data = run.store.pop(run.key)
    return run.data
