"""Autograd through ``forward()`` (upstream's non-fused training): in training mode with
gradients enabled, ``forward()`` runs ``rp_forward_train`` and connects its outputs to one
autograd node whose backward hands the outputs' gradients to ``rp_backward``. So
``loss = criterion(model(x), y); loss.backward()`` accumulates the parameter gradients that the
next ``step()`` uses, as upstream documents; ``forward_backward()`` stays the fast path (it
overlaps forward and backward, where this runs them as two pipelined calls)."""

from __future__ import annotations

from ctypes import c_void_p
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch

from ._dlpack import BorrowedInputs


class PendingBackward:
    """What one training forward leaves for its backward: the engine call to make, once."""

    def __init__(self, run_backward: Callable[[SimpleNamespace], None]):
        self._run = run_backward
        self._done = False

    def backward(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        if self._done:
            raise RuntimeError("RoundPipe: the outputs of one forward() can be back-propagated "
                               "once (retain_graph is not supported)")
        self._done = True
        present = [g.contiguous() for g in grads if g is not None]
        borrowed = BorrowedInputs(present)
        pointers = iter(borrowed.pointers)
        array = (c_void_p * max(1, len(grads)))(
            *[next(pointers) if g is not None else None for g in grads])
        self._run(SimpleNamespace(array=array, count=len(grads), keep=borrowed))


class _EngineBackward(torch.autograd.Function):
    """Identity on the engine's outputs; its backward is the engine's backward."""

    @staticmethod
    def forward(ctx, pending, anchor, *outputs):
        ctx.pending = pending
        ctx.set_materialize_grads(False)  # an unused output's gradient reaches C as NULL
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.pending.backward(grads)
        return (None, None) + (None,) * len(grads)


def connect(outputs: Sequence[torch.Tensor], pending: PendingBackward) -> list[torch.Tensor]:
    """`outputs` (the engine's flat output tensors) as tensors whose backward runs `pending`."""
    # The engine's parameters are not torch leaves: an empty leaf that wants a gradient puts the
    # node into autograd's graph.
    anchor = torch.empty(0, requires_grad=True)
    return list(_EngineBackward.apply(pending, anchor, *outputs))
