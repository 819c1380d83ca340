"""Autograd through ``forward()`` (upstream's non-fused training): in training mode with
gradients enabled, ``forward()`` runs ``rp_forward_train`` and connects its outputs to one
autograd node whose backward hands the outputs' gradients to ``rp_backward``. So
``loss = criterion(model(x), y); loss.backward()`` accumulates the parameter gradients that the
next ``step()`` uses, as upstream documents; ``forward_backward()`` stays the fast path (it
overlaps forward and backward, where this runs them as two pipelined calls). Floating inputs
that require grad get their gradient too (``rp_backward_input_grads``): ``x.grad``, and a
RoundPipe model fed by another one back-propagates into it."""

from __future__ import annotations

from ctypes import c_void_p
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch

from ._dlpack import BorrowedInputs


class PendingBackward:
    """What one training forward leaves for its backward: the engine call to make, once.
    `run_backward(grads)` runs the engine's backward and returns the gradients of the
    forward's inputs (a list, one per input, None where there is none) or None when
    `wants_inputs` is False."""

    def __init__(self, run_backward: Callable[[SimpleNamespace, bool], Optional[list]],
                 wants_inputs: bool = False):
        self._run = run_backward
        self._done = False
        self.wants_inputs = wants_inputs

    def backward(self, grads: Sequence[Optional[torch.Tensor]]) -> Optional[list]:
        if self._done:
            raise RuntimeError("RoundPipe: the outputs of one forward() can be back-propagated "
                               "once (retain_graph is not supported)")
        self._done = True
        present = [g.contiguous() for g in grads if g is not None]
        borrowed = BorrowedInputs(present)
        pointers = iter(borrowed.pointers)
        array = (c_void_p * max(1, len(grads)))(
            *[next(pointers) if g is not None else None for g in grads])
        return self._run(SimpleNamespace(array=array, count=len(grads), keep=borrowed),
                         self.wants_inputs)


class _EngineBackward(torch.autograd.Function):
    """Identity on the engine's outputs; its backward is the engine's backward, which also
    gives the gradients of the inputs that require grad (`input_index`: their positions among
    the engine call's inputs)."""

    @staticmethod
    def forward(ctx, pending, anchor, n_outputs, input_index, *tensors):
        outputs = tensors[:n_outputs]
        ctx.pending = pending
        ctx.n_outputs = n_outputs
        ctx.input_index = input_index
        ctx.input_meta = [(t.dtype, t.device) for t in tensors[n_outputs:]]
        ctx.set_materialize_grads(False)  # an unused output's gradient reaches C as NULL
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        input_grads = ctx.pending.backward(grads)
        out = []
        for i, (dtype, device) in zip(ctx.input_index, ctx.input_meta):
            g = input_grads[i] if input_grads is not None and i < len(input_grads) else None
            out.append(g.to(device=device, dtype=dtype) if g is not None else None)
        return (None, None, None, None) + (None,) * ctx.n_outputs + tuple(out)


def inputs_wanting_grad(tensors: Sequence[object]) -> list[int]:
    """Positions of the floating tensors among the engine call's inputs that require grad."""
    return [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and
            t.requires_grad and t.is_floating_point()]


def connect(outputs: Sequence[torch.Tensor], pending: PendingBackward,
            inputs: Sequence[torch.Tensor] = (), input_index: Sequence[int] = ()
            ) -> list[torch.Tensor]:
    """`outputs` (the engine's flat output tensors) as tensors whose backward runs `pending`,
    and gives `inputs` (the call's inputs at `input_index`) their gradients."""
    # The engine's parameters are not torch leaves: an empty leaf that wants a gradient puts the
    # node into autograd's graph.
    anchor = torch.empty(0, requires_grad=True)
    return list(_EngineBackward.apply(pending, anchor, len(outputs), tuple(input_index),
                                      *outputs, *inputs))
