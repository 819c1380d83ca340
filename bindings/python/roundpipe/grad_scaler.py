"""``roundpipe.GradScaler``: upstream's gradient scaler for asynchronous optimizer steps.

Interface and scale schedule are ``torch.amp.GradScaler``'s (``scale``, ``unscale_``, ``step``,
``update``, ``get_scale``, the growth / backoff getters and setters, ``state_dict``). What it
adds is RoundPipe's threading: ``scale()`` runs inside ``loss_fn`` (library threads),
``unscale_()`` / ``step()`` inside ``step_fn`` on the model's optimizer thread, possibly while
the next ``forward_backward`` already runs, and ``update()`` on the driving thread::

    scaler = roundpipe.GradScaler()
    loss = model.forward_backward((x,), label=y,
                                  loss_fn=lambda out, y: scaler.scale(crit(out.float(), y)) / n)
    model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))
    scaler.update()

How the asynchronous pieces fit:

- Every ``step_fn`` unscales with the scale its gradients were made with: ``RoundPipe.step()``
  takes a snapshot of the scale of each scaler that scaled the model's losses, and
  ``get_scale()`` / ``unscale_()`` / ``step()`` on the optimizer thread use it, whatever
  ``update()`` did on the driving thread meanwhile.
- ``update(is_async=True)`` (default) applies the inf checks of the steps that have finished:
  with ``model.step(is_async=True)`` those of the previous iterations, so a skipped step lowers
  the scale used one iteration later (staleness one, like the weights; upstream: "the updated
  scale will take effect on the next call to update()"). ``update(is_async=False)`` first waits
  for every step of the models it serves (``synchronize()``), then applies all of them: with
  ``model.step(is_async=False)`` this is exactly ``torch.amp.GradScaler``'s schedule.
- A step whose gradients hold inf or nan is skipped (``optimizer.step()`` is not called) and
  the scale is multiplied by ``backoff_factor``; ``growth_interval`` good steps in a row
  multiply it by ``growth_factor``. Every skip is logged at WARNING on the ``"roundpipe"``
  logger; every scale change at INFO.

The engine's own loss scaler (``RoundPipe(grad_scaler=...)``, on by default for float16 models)
and its ``skip_nonfinite_steps`` rule (on by default) would skip a step with inf / nan gradients
before ``step_fn`` runs. Upstream's ``step_fn`` always runs and ``scaler.step(optimizer)``
decides, so the first ``RoundPipe.step(step_fn)`` after a GradScaler has scaled the model's
losses switches both off on the live model (``rp_model_set_skip_nonfinite_steps``,
``rp_model_set_grad_scaler``), before that step is queued. From then on this scaler does all
the scaling, exactly as ``torch.amp.GradScaler``. The steps before the hand-over (the losses of
the first iteration, on a model whose engine scaler was on) were scaled by the engine: for them
``scale()`` multiplied the loss value only and ``unscale_()`` finds the gradients already
unscaled (it still checks them). A step the engine skipped before the hand-over (``step_fn``
did not run) is logged and lowers this scaler's scale as any skipped step does.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .context import OptimizerCtx

__all__ = ["GradScaler", "StepTracker"]

logger = logging.getLogger("roundpipe")

_local = threading.local()  # .step: the _StepContext running here; .loss: the StepTracker


def _f32(value: float) -> float:
    """`value` rounded to float32, as torch.amp keeps its scale."""
    return float(torch.tensor(value, dtype=torch.float32))


class _Epoch:
    """The inf checks of the steps enqueued between two update() calls."""

    __slots__ = ("pending", "checked", "found_inf", "has_async")

    def __init__(self) -> None:
        self.pending = 0  # asynchronous steps that have not reported yet
        self.checked = False
        self.found_inf = False
        self.has_async = False


class _OptState:
    __slots__ = ("unscaled", "stepped", "found_inf")

    def __init__(self) -> None:
        self.unscaled = False
        self.stepped = False
        self.found_inf = False


class GradScaler:
    """Gradient scaler for RoundPipe's asynchronous optimizer steps (upstream's
    ``roundpipe.GradScaler``; drop-in for ``torch.amp.GradScaler``).

    Args:
        init_scale: initial scale factor (default ``2**16``).
        growth_factor: multiplies the scale after ``growth_interval`` good steps in a row
            (default 2.0; must be > 1).
        backoff_factor: multiplies the scale after a step with inf / nan gradients (default
            0.5; in (0, 1)).
        growth_interval: good steps in a row before the scale grows (default 2000; >= 1).
        enabled: False makes ``step`` call ``optimizer.step()`` directly and every other method
            a no-op (``get_scale()`` is 1.0).

    See the module docstring for the asynchronous semantics and how it works with the
    engine's own fp16 loss scaler.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        if not float(init_scale) > 0:
            raise ValueError("init_scale must be > 0, got %r" % (init_scale,))
        if not float(growth_factor) > 1.0:
            raise ValueError("growth_factor must be > 1, got %r" % (growth_factor,))
        if not 0.0 < float(backoff_factor) < 1.0:
            raise ValueError("backoff_factor must be in (0, 1), got %r" % (backoff_factor,))
        if int(growth_interval) < 1:
            raise ValueError("growth_interval must be >= 1, got %r" % (growth_interval,))
        self._enabled = bool(enabled)
        self._init_scale = float(init_scale)
        self._scale = _f32(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._cond = threading.Condition()
        self._epoch = 0  # number of update() calls so far
        self._epochs: Dict[int, _Epoch] = {}
        self._main_states: Dict[int, _OptState] = {}  # per optimizer, off the optimizer thread
        self._trackers: "weakref.WeakSet[StepTracker]" = weakref.WeakSet()

    # -- scaling ----------------------------------------------------------------------------

    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]
              ) -> Union[torch.Tensor, Iterable[torch.Tensor]]:
        """Multiply a tensor (or an iterable of tensors) by the scale factor; typically the loss
        inside ``loss_fn``. Returned unchanged when scaling is disabled. On a model whose
        engine loss scaler is on, only the value is scaled (the engine scales the gradient)."""
        if not self._enabled:
            return outputs
        tracker = getattr(_local, "loss", None)
        value_only = False
        if tracker is not None:
            tracker.add_scaler(self)
            value_only = tracker.engine_scaled
        return _scaled(outputs, self._scale, value_only)

    def _step_context(self) -> Optional["_StepContext"]:
        return getattr(_local, "step", None)

    def _opt_state(self, optimizer: Any) -> _OptState:
        ctx = self._step_context()
        states = ctx.opt_states if ctx is not None else self._main_states
        key = (id(self), id(optimizer))
        state = states.get(key)
        if state is None:
            state = states[key] = _OptState()
        return state

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of `optimizer`'s parameters by the scale their step was made
        with, and check them for inf / nan. Optional: ``step()`` does it when not done. Inside
        ``step_fn`` it acts on that step's gradients; elsewhere (after ``synchronize()``) on the
        accumulated ones, with the current scale."""
        if not self._enabled:
            return
        state = self._opt_state(optimizer)
        if state.unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update() (in this step).")
        if state.stepped:
            raise RuntimeError("unscale_() is being called after step().")
        ctx = self._step_context()
        if ctx is not None:
            divisor = 1.0 if ctx.engine_scaled else ctx.scale_of(self)
        else:
            divisor = self._scale
        state.found_inf = _unscale_grads(optimizer, 1.0 / divisor)
        state.unscaled = True

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[Any]:
        """``unscale_(optimizer)`` if not done yet, then ``optimizer.step(*args, **kwargs)``
        unless the gradients hold inf or nan (then the step is skipped, a warning is logged
        and the next ``update()`` lowers the scale). Returns ``optimizer.step()``'s value, or
        None when skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is "
                               "enabled.")
        state = self._opt_state(optimizer)
        if state.stepped:
            raise RuntimeError("step() has already been called since the last update() (in "
                               "this step).")
        if not state.unscaled:
            self.unscale_(optimizer)
        state.stepped = True
        ctx = self._step_context()
        if ctx is not None:
            ctx.record(self, state.found_inf)
            scale = ctx.scale_of(self)
        else:
            self._post(self._epoch, state.found_inf, counted=False)
            scale = self._scale
        if state.found_inf:
            logger.warning("GradScaler: the gradients hold inf or nan (scale %g); "
                           "optimizer.step() skipped, the scale backs off by %g at update()",
                           scale, self._backoff_factor)
            return None
        return optimizer.step(*args, **kwargs)

    # -- schedule ---------------------------------------------------------------------------

    def _enqueue(self, is_async: bool, tracker: "StepTracker") -> Tuple[float, int]:
        """A step of a model that uses this scaler is being enqueued: (its scale, its epoch)."""
        with self._cond:
            epoch = self._epochs.setdefault(self._epoch, _Epoch())
            if is_async:
                epoch.pending += 1
                epoch.has_async = True
            self._trackers.add(tracker)
            return self._scale, self._epoch

    def _post(self, epoch: int, found_inf: Optional[bool], counted: bool) -> None:
        """A step of `epoch` reports: found_inf (None: no inf check ran in it)."""
        with self._cond:
            record = self._epochs.setdefault(epoch, _Epoch())
            if found_inf is not None:
                record.checked = True
                record.found_inf = record.found_inf or bool(found_inf)
            if counted:
                record.pending -= 1
            self._cond.notify_all()

    def _apply(self, found_inf: bool) -> None:
        old = self._scale
        if found_inf:
            self._scale = _f32(old * self._backoff_factor)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                grown = _f32(old * self._growth_factor)
                if grown != float("inf"):
                    self._scale = grown
                self._growth_tracker = 0
        if self._scale != old:
            logger.info("GradScaler: scale %g -> %g", old, self._scale)

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None,
               is_async: bool = True) -> None:
        """Update the scale from the inf checks of the finished steps (driving thread).

        Args:
            new_scale: set the scale to this value instead (copied; pending checks dropped).
            is_async: as the ``is_async`` of ``RoundPipe.step()``. True: apply the checks of
                the steps that have finished (with asynchronous steps: the previous
                iterations'; the current one's count at the next update()). False: wait for
                every step of the models this scaler serves (``synchronize()``), then apply all.
        """
        if not self._enabled:
            return
        if not is_async:
            for tracker in list(self._trackers):
                tracker.settle_all()
        with self._cond:
            current = self._epoch
            if not is_async and not self._cond.wait_for(lambda: all(
                    e.pending <= 0 for k, e in self._epochs.items() if k <= current), 60.0):
                # settle_all() waited for every step it knows of; a check still missing after
                # that is left out of this update: said, not silently
                logger.warning("GradScaler.update(is_async=False): inf checks of %d step(s) "
                               "still pending after 60 s; the scale is updated without them",
                               sum(e.pending for k, e in self._epochs.items()
                                   if k <= current and e.pending > 0))
            if new_scale is not None:
                if isinstance(new_scale, torch.Tensor):
                    if new_scale.numel() != 1:
                        raise ValueError("new_scale must be a single-element tensor")
                    new_scale = new_scale.item()
                for k in [k for k in self._epochs if k <= current]:
                    del self._epochs[k]
                self._scale = _f32(float(new_scale))
            else:
                for k in sorted(self._epochs):
                    if k > current:
                        break
                    record = self._epochs[k]
                    if is_async and (record.pending > 0 or (k == current and record.has_async)):
                        break  # not finished, or this iteration's: the next update() applies it
                    del self._epochs[k]
                    if record.checked:
                        self._apply(record.found_inf)
            self._epoch = current + 1
            self._main_states.clear()

    # -- queries ----------------------------------------------------------------------------

    def get_scale(self) -> float:
        """The scale factor (1.0 when disabled): inside ``step_fn``, the scale that step's
        gradients were made with; elsewhere the scale ``scale()`` applies now."""
        if not self._enabled:
            return 1.0
        ctx = self._step_context()
        if ctx is not None:
            return ctx.scale_of(self)
        return self._scale

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        """The growth factor (setters take effect at once: always up to date)."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        """The backoff factor (setters take effect at once: always up to date)."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        """The growth interval (setters take effect at once: always up to date)."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> Dict[str, Any]:
        """torch.amp.GradScaler's state dict (empty when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.amp.GradScaler``."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        scale = state_dict["scale"]
        self._scale = _f32(float(scale.item() if isinstance(scale, torch.Tensor) else scale))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        tracker = state_dict["_growth_tracker"]
        self._growth_tracker = int(tracker.item() if isinstance(tracker, torch.Tensor)
                                   else tracker)

    def __getstate__(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_cond", "_epochs", "_main_states", "_trackers", "_epoch")}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return ("roundpipe.GradScaler(scale=%g, growth_factor=%g, backoff_factor=%g, "
                "growth_interval=%d, enabled=%s)" % (self._scale, self._growth_factor,
                                                    self._backoff_factor, self._growth_interval,
                                                    self._enabled))


def _scaled(outputs: Any, scale: float, value_only: bool) -> Any:
    if isinstance(outputs, torch.Tensor):
        if value_only:  # value * scale, gradient unscaled (the engine scales it)
            return outputs + (scale - 1.0) * outputs.detach()
        return outputs * scale
    if isinstance(outputs, (list, tuple)):
        items = [_scaled(o, scale, value_only) for o in outputs]
        return type(outputs)(items) if type(outputs) in (list, tuple) else type(outputs)(*items)
    if isinstance(outputs, Iterable):
        return map(lambda o: _scaled(o, scale, value_only), outputs)
    raise ValueError("outputs must be a Tensor or an iterable of Tensors")


def _unscale_grads(optimizer: torch.optim.Optimizer, inv_scale: float) -> bool:
    """Multiply every gradient by inv_scale in place; True when any holds inf or nan."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    found = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                if g.dtype is torch.float16:
                    p.grad = g = g.coalesce()
                values = g._values()
                found = found or not bool(torch.isfinite(values).all())
                values.mul_(inv_scale)
                continue
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in groups.items():
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        found = found or bool(found_inf.item())
    return found


class _StepContext:
    """One ``step_fn`` enqueued by ``RoundPipe.step()``: the scales its gradients carry (one per
    scaler that scaled the model's losses), its inf checks, whether it ran."""

    def __init__(self, tracker: "StepTracker", fn: Callable[..., Any], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any], number: int, is_async: bool) -> None:
        self.tracker = tracker
        self.engine_scaled = tracker.engine_scaled
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.number = number
        self.is_async = is_async
        self.scalers: Dict[GradScaler, Tuple[float, int, bool]] = {}  # scale, epoch, counted
        self.found: Dict[GradScaler, bool] = {}
        self.opt_states: Dict[Tuple[int, int], _OptState] = {}
        self.lock = threading.Lock()
        self.ran = False
        self.posted = False

    def register(self, scaler: GradScaler, counted: bool) -> Tuple[float, int, bool]:
        scale, epoch = scaler._enqueue(self.is_async and counted, self.tracker)
        entry = (scale, epoch, self.is_async and counted)
        self.scalers[scaler] = entry
        return entry

    def scale_of(self, scaler: GradScaler) -> float:
        with self.lock:
            entry = self.scalers.get(scaler)
            if entry is None:  # first met inside step_fn: its current scale, not counted
                self.tracker.add_scaler(scaler)
                entry = self.register(scaler, counted=False)
            return entry[0]

    def record(self, scaler: GradScaler, found_inf: bool) -> None:
        self.scale_of(scaler)
        with self.lock:
            self.found[scaler] = self.found.get(scaler, False) or found_inf

    def __call__(self) -> Any:  # on the optimizer thread
        self.ran = True
        previous = getattr(_local, "step", None)
        _local.step = self
        try:
            with OptimizerCtx():
                return self.fn(*self.args, **self.kwargs)
        finally:
            _local.step = previous
            self.post()

    def post(self, skipped: bool = False, report: bool = True) -> None:
        with self.lock:
            if self.posted:
                return
            self.posted = True
            entries = list(self.scalers.items())
        for scaler, (_, epoch, counted) in entries:
            found: Optional[bool] = True if skipped else self.found.get(scaler)
            scaler._post(epoch, found if report else None, counted)


class StepTracker:
    """Per model (``RoundPipe._steps``): wraps its Python ``loss_fn`` and ``step_fn`` so that
    GradScalers know which model and which step they serve, and finds the steps whose
    ``step_fn`` the engine did not run (skipped for inf / nan gradients). Driving thread,
    apart from the wrappers themselves."""

    def __init__(self, engine_scaled: bool, name: str,
                 synchronize: Optional[Callable[[], None]] = None) -> None:
        self.engine_scaled = bool(engine_scaled)
        self.name = name
        self._sync = weakref.WeakMethod(synchronize) if synchronize is not None else None
        self._lock = threading.Lock()
        self._scalers: "weakref.WeakSet[GradScaler]" = weakref.WeakSet()
        self._pending: List[_StepContext] = []
        self._count = 0
        # RoundPipe.step() has switched the engine's loss scaler and non-finite skipping off
        # because a GradScaler serves the model (every step_fn runs from then on).
        self.handed_over = False

    def has_scalers(self) -> bool:
        """A GradScaler (enabled) has scaled this model's losses."""
        with self._lock:
            return any(s._enabled for s in self._scalers)

    def add_scaler(self, scaler: GradScaler) -> None:
        with self._lock:
            self._scalers.add(scaler)

    def wrap_loss(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """`fn` run with this model's context, for ``GradScaler.scale``."""
        def loss_fn(outputs: Any, labels: Any) -> Any:
            previous = getattr(_local, "loss", None)
            _local.loss = self
            try:
                return fn(outputs, labels)
            finally:
                _local.loss = previous
        return loss_fn

    def begin_step(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                   is_async: bool) -> _StepContext:
        """The callable to enqueue for step_fn(*args, **kwargs)."""
        self._count += 1
        ctx = _StepContext(self, fn, args, kwargs, self._count, is_async)
        with self._lock:
            scalers = [s for s in self._scalers if s._enabled]
        for scaler in scalers:
            ctx.register(scaler, counted=True)
        self._pending.append(ctx)
        return ctx

    def cancel(self, ctx: _StepContext) -> None:
        """`ctx` was never enqueued."""
        if ctx in self._pending:
            self._pending.remove(ctx)
        ctx.post(report=False)

    def settle(self, latest_done: bool) -> None:
        """After a C call that waited for the earlier steps (and the latest one too when
        `latest_done`): a step whose step_fn did not run was skipped by the engine."""
        done = self._pending if latest_done else self._pending[:-1]
        self._pending = [] if latest_done else self._pending[-1:]
        for ctx in done:
            if ctx.ran:
                continue
            logger.warning(
                "%s: step_fn of step %d did not run: the engine skipped the step because its "
                "gradients hold inf or nan (%s); the weights are unchanged%s", self.name,
                ctx.number, "the engine's fp16 loss scaler backs off" if self.engine_scaled
                else "skip_nonfinite_steps=True", "; GradScaler scale backs off at update()"
                if ctx.scalers else "")
            ctx.post(skipped=True)

    def settle_all(self) -> None:
        """Wait for every step of the model (its synchronize(), which settles)."""
        if not self._pending:
            return
        sync = self._sync() if self._sync is not None else None
        if sync is not None:
            sync()
