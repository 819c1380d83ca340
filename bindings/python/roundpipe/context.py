"""Upstream's runtime contexts: :class:`OptimizerCtx` (optimizer-related scopes) and the
recompute-data helpers (re-exported from :mod:`roundpipe.recompute`).

Inside ``with OptimizerCtx():`` (and inside every ``step_fn`` that :meth:`RoundPipe.step` runs,
on the optimizer thread) a RoundPipe's ``parameters()`` / ``named_parameters()`` are its
``optim_parameters()`` / ``optim_named_parameters()``: the fp32 (``optim_dtype``) master
weights the engine updates, which is what an optimizer must be built over::

    with roundpipe.OptimizerCtx():
        optimizer = roundpipe.optim.Adam(model.parameters(), lr=1e-3)

(The engine keeps one host copy of each parameter that Python can reach, the master weight, so
``parameters()`` gives those Parameters outside the context as well: the context is what makes
upstream's code read as written, and :func:`in_optimizer_ctx` tells whether it is active.)
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Optional, Type

from .recompute import doing_recompute, get_recompute_data, save_for_recompute

__all__ = ["OptimizerCtx", "in_optimizer_ctx", "save_for_recompute", "doing_recompute",
           "get_recompute_data"]

_state = threading.local()


class OptimizerCtx:
    """Context manager marking the current scope (of this thread) as optimizer work: a
    RoundPipe's ``parameters()`` and ``named_parameters()`` are its ``optim_parameters()`` and
    ``optim_named_parameters()`` there. Reentrant; thread-local, as upstream's."""

    def __enter__(self) -> "OptimizerCtx":
        _state.depth = getattr(_state, "depth", 0) + 1
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        _state.depth = getattr(_state, "depth", 1) - 1


def in_optimizer_ctx() -> bool:
    """True inside ``with OptimizerCtx():`` or a ``step_fn`` on this thread."""
    return getattr(_state, "depth", 0) > 0
