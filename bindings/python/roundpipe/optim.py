"""CPU optimizers: upstream's :class:`Adam` (a torch.optim optimizer for ``step_fn``), and the
settings objects of the engine's built-in AdamW and SGD (:class:`AdamW`, :class:`SGD`).

``Adam`` is upstream's ``roundpipe.optim.Adam``: ``torch.optim.Adam``'s interface over
``optim_parameters()``, run inside a step function::

    with roundpipe.OptimizerCtx():
        optimizer = roundpipe.optim.Adam(model.parameters(), lr=1e-3)
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))

The built-in settings objects are passed to :meth:`RoundPipe.step` instead of a step function
(no Python on the optimizer thread)::

    opt = roundpipe.optim.AdamW(lr=1e-3, weight_decay=0.01)
    for x, y in data:
        model.forward_backward((x,), label=y, loss_fn="mse")
        model.step(opt)          # runs in C++ on the optimizer thread, no Python involved
    opt.lr = 5e-4                # takes effect at the next step

They compute exactly what ``torch.optim.AdamW`` / ``torch.optim.SGD`` compute (defaults
included), on the engine's fp32 master weights. The optimizer state (moments, momentum
buffers) lives in the model, not in this object, so one settings object may serve several
models; a model refuses a step of another kind than the one that created its state.
Hyperparameters are validated by the engine when set (RoundPipeError).
"""

from __future__ import annotations

import warnings
from ctypes import c_int64, c_void_p
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.utils.dlpack

from . import _capi
from ._dlpack import _DLTENSOR, _api
from ._internals import Optimizer
from .errors import RoundPipeUnsupportedError

__all__ = ["Adam", "AdamW", "SGD", "BuiltinOptimizer"]

ParamsT = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]],
                Iterable[Tuple[str, torch.Tensor]]]


class Adam(torch.optim.Adam):
    """Upstream's ``roundpipe.optim.Adam``: Adam (AdamW with ``decoupled_weight_decay=True``)
    on CPU in fp32, over ``optim_parameters()``, for use inside ``step_fn``.

    The interface is ``torch.optim.Adam``'s (a drop-in replacement); the update is the engine's
    own AdamW kernel (``rp_adam_apply``: the code the built-in :class:`AdamW` runs, vectorised
    and split over the optimizer thread's OpenMP threads, ``RP_OPTIMIZER_THREADS`` included),
    one C call per parameter group. State dicts are ``torch.optim.Adam``'s (``step``,
    ``exp_avg``, ``exp_avg_sq`` per parameter), so one saved by ``torch.optim.Adam`` loads here
    and the other way round.

    ``amsgrad=True`` and ``maximize=True`` are supported through torch's fused CPU kernel
    instead (slower). ``foreach`` and ``fused`` are accepted for compatibility and ignored with a
    warning; ``capturable=True`` and ``differentiable=True`` are not supported
    (RoundPipeUnsupportedError). Every parameter must be a contiguous float32 CPU tensor and
    gradients must be dense (ValueError naming the parameter otherwise).
    """

    def __init__(self, params: ParamsT, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]]
                 = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: bool = False) -> None:
        if foreach is not None:
            warnings.warn("roundpipe.optim.Adam: foreach is ignored (the update is a fused CPU "
                          "kernel)", stacklevel=2)
        if fused is not None:
            warnings.warn("roundpipe.optim.Adam: fused is ignored (the update is always a fused "
                          "CPU kernel)", stacklevel=2)
        if capturable:
            raise RoundPipeUnsupportedError("roundpipe.optim.Adam: capturable=True is not "
                                            "supported (CPU optimizer)")
        if differentiable:
            raise RoundPipeUnsupportedError("roundpipe.optim.Adam: differentiable=True is not "
                                            "supported")
        # fused=True: torch's fused CPU kernel is the fallback for amsgrad / maximize, and its
        # state layout (a float32 step tensor per parameter) is the one kept here.
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, fused=True,
                         decoupled_weight_decay=decoupled_weight_decay)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            _check_param(p)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One Adam update of every parameter with a gradient."""
        if any(g["amsgrad"] or g["maximize"] for g in self.param_groups):
            self._check_grads()
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _check_grads(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _checked_grad(p)

    def _step_group(self, group: Dict[str, Any]) -> None:
        """One rp_adam_apply over the parameters of `group` that have a gradient. The step
        counts advance only once the call succeeded (a refused call changes nothing)."""
        params, grads, exp_avgs, exp_avg_sqs, counters = [], [], [], [], []
        state_of = self.state
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse or not g.is_contiguous():
                g = _checked_grad(p)
            state = state_of[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if not (m.is_contiguous() and v.is_contiguous()):  # e.g. from a loaded state dict
                m = state["exp_avg"] = m.contiguous()
                v = state["exp_avg_sq"] = v.contiguous()
            params.append(p)
            grads.append(g)
            exp_avgs.append(m)
            exp_avg_sqs.append(v)
            counters.append(state["step"])
        if not params:
            return
        steps = [int(round(s)) + 1 for s in torch.stack(counters).tolist()]
        beta1, beta2 = (float(b) for b in group["betas"])
        keep = []  # the capsules own the DLPack views of the gradients until the call returns
        fixed = self._fixed_arrays(group, params, exp_avgs, exp_avg_sqs)
        _capi.lib().rp_adam_apply(fixed[0], _dlpack_array(grads, keep), fixed[1], fixed[2],
                                  (c_int64 * len(steps))(*steps), len(steps),
                                  float(group["lr"]), beta1, beta2, float(group["eps"]),
                                  float(group["weight_decay"]),
                                  int(bool(group.get("decoupled_weight_decay", False))))
        torch._foreach_add_(counters, 1.0)

    def _fixed_arrays(self, group: Dict[str, Any], params: List[torch.Tensor],
                      exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor]) -> Any:
        """The DLPack arrays of the weights and moments of `group`, kept from one step to the
        next while they are the same tensors (they are updated in place): only the gradients
        need new views each step. The cache holds its tensors, so their ids stay unique."""
        key = tuple(id(t) for ts in (params, exp_avgs, exp_avg_sqs) for t in ts)
        cache = self.__dict__.setdefault("_rp_arrays", {})
        entry = cache.get(id(group))
        if entry is None or entry[0] != key:
            keep: List[Any] = []
            arrays = tuple(_dlpack_array(ts, keep) for ts in (params, exp_avgs, exp_avg_sqs))
            entry = cache[id(group)] = (key, arrays, keep, group)
        return entry[1]


def _dlpack_array(tensors: List[torch.Tensor], keep: List[Any]) -> Any:
    """A ``DLManagedTensor *[n]`` of zero-copy DLPack views of `tensors`; their capsules are
    appended to `keep`, which must outlive the C call."""
    to_dlpack = torch.utils.dlpack.to_dlpack
    pointer = _api.PyCapsule_GetPointer
    ptrs = []
    for t in tensors:
        capsule = to_dlpack(t.detach())
        keep.append(capsule)
        ptrs.append(pointer(capsule, _DLTENSOR))
    return (c_void_p * len(ptrs))(*ptrs)


def _checked_grad(p: torch.Tensor) -> torch.Tensor:
    """p.grad, dense, float32, on the CPU and contiguous (made so, and stored back, if not)."""
    g = p.grad
    if g.is_sparse:
        raise ValueError("roundpipe.optim.Adam does not support sparse gradients")
    if g.dtype != torch.float32 or g.device.type != "cpu":
        raise ValueError("roundpipe.optim.Adam: gradients must be float32 CPU "
                         "tensors, got %s on %s" % (g.dtype, g.device))
    if not g.is_contiguous():
        p.grad = g = g.contiguous()
    return g


def _check_param(p: torch.Tensor) -> None:
    if p.dtype != torch.float32 or p.device.type != "cpu":
        raise ValueError("roundpipe.optim.Adam supports float32 CPU tensors only, got a %s "
                         "tensor on %s (build it over model.optim_parameters())"
                         % (p.dtype, p.device))
    if not p.is_contiguous():
        raise ValueError("roundpipe.optim.Adam: every parameter must be contiguous")


class BuiltinOptimizer:
    """Base class: settings over an ``rp_optimizer`` (owned by ``_internals.Optimizer``:
    close() / context manager / __del__)."""

    _kind: Optional[int] = None

    def __init__(self) -> None:
        self._settings = Optimizer(self._kind)

    @property
    def handle(self) -> Any:
        """The ``rp_optimizer *`` (ctypes); ValueError once closed."""
        return self._settings.handle

    def close(self) -> None:
        self._settings.close()

    def __enter__(self) -> "BuiltinOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._settings.set("learning_rate", float(value))
        self._lr = float(value)

    @property
    def weight_decay(self) -> float:
        return self._weight_decay

    @weight_decay.setter
    def weight_decay(self, value: float) -> None:
        self._settings.set("weight_decay", float(value))
        self._weight_decay = float(value)


class AdamW(BuiltinOptimizer):
    """Settings of the built-in AdamW (as ``torch.optim.AdamW``, same defaults)."""

    _kind = _capi.RP_OPTIMIZER_ADAMW

    def __init__(self, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay

    @property
    def betas(self) -> Tuple[float, float]:
        return self._betas

    @betas.setter
    def betas(self, value: Tuple[float, float]) -> None:
        b1, b2 = (float(v) for v in value)
        self._settings.set("betas", b1, b2)
        self._betas = (b1, b2)

    @property
    def eps(self) -> float:
        return self._eps

    @eps.setter
    def eps(self, value: float) -> None:
        self._settings.set("eps", float(value))
        self._eps = float(value)

    def __repr__(self) -> str:
        return "roundpipe.optim.AdamW(lr=%g, betas=%r, eps=%g, weight_decay=%g)" % (
            self.lr, self.betas, self.eps, self.weight_decay)


class SGD(BuiltinOptimizer):
    """Settings of the built-in SGD (as ``torch.optim.SGD`` with dampening 0, no Nesterov)."""

    _kind = _capi.RP_OPTIMIZER_SGD

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__()
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay

    @property
    def momentum(self) -> float:
        return self._momentum

    @momentum.setter
    def momentum(self, value: float) -> None:
        self._settings.set("momentum", float(value))
        self._momentum = float(value)

    def __repr__(self) -> str:
        return "roundpipe.optim.SGD(lr=%g, momentum=%g, weight_decay=%g)" % (
            self.lr, self.momentum, self.weight_decay)
