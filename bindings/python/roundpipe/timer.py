"""ModelTimer: upstream's per-layer timing, read from the engine's trace.

The engine times every microbatch computation of every stage (``rp_model_trace_json``: one
compute event per (job, microbatch) of the last call, host clock on CPU worker devices, CUDA
events on GPUs). After each call of a model, :class:`ModelTimer` turns that record into one
*record* per (stage, action): the mean time of one microbatch, in ms, and keeps a smoothed
*estimate* (exponential moving average, :attr:`ModelTimer.SMOOTHING`). With
``ModelTimer.VERBOSE = True`` it prints them to stderr after every call, in upstream's format::

    Layer 0 fwd  new record: 1.234 ms  new estimate: 1.200 ms

How it differs from upstream (the engine measures stages, not layers, and fuses recompute):

- a stage of several layers is one line, ``Layer 2-4 ...`` (its first and last layer); with one
  layer per stage (e.g. ``RoundPipe(..., stage_plan=[1] * n)``) every line is one layer, as
  upstream prints;
- actions are ``fwd`` (forward), ``bwd`` (recompute and backward of a stage: the engine runs and
  times them as one job, so no separate ``re`` line) and ``tail`` (the fused last stage of
  ``forward_backward()``: forward, loss and backward).
"""

import sys
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, NamedTuple, Optional, Tuple

if TYPE_CHECKING:
    from .model import RoundPipe

__all__ = ["ModelTimer", "TimerRecord"]

_ACTIONS = {"forward": "fwd", "backward": "bwd", "tail": "tail"}
_ORDER = {"fwd": 0, "re": 1, "tail": 2, "bwd": 3}


class TimerRecord(NamedTuple):
    """One (stage, action) of one call: the stage's layers, the action ("fwd", "bwd" or
    "tail"), the mean microbatch time of this call and the smoothed estimate, in ms."""

    layers: range
    action: str
    record_ms: float
    estimate_ms: float

    @property
    def label(self) -> str:
        """"0" for a one-layer stage, "2-4" for layers 2 to 4."""
        first, last = self.layers.start, self.layers.stop - 1
        return str(first) if first == last else "%d-%d" % (first, last)

    def line(self) -> str:
        """Upstream's line: ``Layer 0 fwd  new record: 1.234 ms  new estimate: 1.200 ms``."""
        return "Layer %s %-3s  new record: %.3f ms  new estimate: %.3f ms" % (
            self.label, self.action, self.record_ms, self.estimate_ms)


class ModelTimer:
    """Per-stage timing of one RoundPipe model (``model.timer``), updated from the engine's
    trace after each ``forward()`` / ``forward_backward()`` while :attr:`VERBOSE` is on, or
    when :meth:`update` is called."""

    #: Print one line per stage and action to stderr after every call (upstream's flag).
    VERBOSE: ClassVar[bool] = False
    #: Weight of a new record in the estimate: estimate = (1 - s) * estimate + s * record.
    SMOOTHING: ClassVar[float] = 0.5

    def __init__(self, model: "RoundPipe") -> None:
        self._model = model
        self._estimates: Dict[Tuple[range, str], float] = {}
        self.records: List[TimerRecord] = []

    def update(self, trace: Optional[Dict[str, Any]] = None) -> List[TimerRecord]:
        """Read the engine's record of the model's last call (or `trace`, a dict of
        ``model.trace()``), update the estimates and return this call's records; print them
        to stderr when :attr:`VERBOSE` is on."""
        if trace is None:
            trace = self._model.trace()
        stages = _stage_ranges(self._model.stage_plan())
        sums: Dict[Tuple[int, str], List[float]] = {}
        for event in trace.get("traceEvents", ()):
            if event.get("ph") != "X" or event.get("cat") != "compute":
                continue
            args = event.get("args") or {}
            action = _ACTIONS.get(args.get("kind"))
            stage = args.get("stage")
            if action is None or not isinstance(stage, int) or not 0 <= stage < len(stages):
                continue
            entry = sums.setdefault((stage, action), [0.0, 0])
            entry[0] += float(event.get("dur", 0.0)) / 1000.0  # us -> ms
            entry[1] += 1
        records = []
        for (stage, action), (total, count) in sorted(
                sums.items(), key=lambda kv: (kv[0][0], _ORDER[kv[0][1]])):
            record = total / count
            key = (stages[stage], action)
            old = self._estimates.get(key)
            estimate = record if old is None else \
                (1.0 - self.SMOOTHING) * old + self.SMOOTHING * record
            self._estimates[key] = estimate
            records.append(TimerRecord(stages[stage], action, record, estimate))
        self.records = records
        if self.VERBOSE:
            for r in records:
                print(r.line(), file=sys.stderr)
        return records

    @classmethod
    def of(cls, model: "RoundPipe") -> "ModelTimer":
        """The timer of `model` (made at its first use)."""
        timer = model.__dict__.get("_timer")
        if timer is None:
            timer = cls(model)
            model.__dict__["_timer"] = timer
        return timer

    @classmethod
    def after_call(cls, model: "RoundPipe") -> None:
        """Called after every forward() / forward_backward(): update `model`'s timer (and
        print) while VERBOSE is on."""
        if cls.VERBOSE:
            cls.of(model).update()

    def estimate(self, layers: range, action: str) -> Optional[float]:
        """The smoothed estimate (ms per microbatch) of a stage's action, or None."""
        return self._estimates.get((layers, action))

    @property
    def estimates(self) -> Dict[Tuple[range, str], float]:
        """(stage layers, action) -> smoothed estimate in ms per microbatch."""
        return dict(self._estimates)


def _stage_ranges(counts: List[int]) -> List[range]:
    out, at = [], 0
    for n in counts:
        out.append(range(at, at + n))
        at += n
    return out
