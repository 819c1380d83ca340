"""ModelExecutePlan: upstream's execution plan, mapped onto the engine's stage plan.

Upstream's plan names the layers of each forward stage (``fwd_plan``) and of each backward
stage (``bwd_plan``) separately, per call. The engine holds the same two things: a stage plan
(``rp_model_options_set_stage_plan`` at creation, ``rp_model_set_stage_plan`` later; else the
planner's for the call's shape) and, optionally, a backward stage plan
(``rp_model_set_backward_stage_plan``; else backward runs the forward stages), both as layers
per stage counted from layer 0 (``rp_model_stage_plan`` / ``rp_model_backward_stage_plan`` read
them back). ``forward()`` runs every stage forward; ``forward_backward()`` runs stages 0..S-2
forward, fuses forward, loss and backward of the last (tail) stage, then runs the backward
stages below the tail, deepest first, each recomputed from the input the forward kept for it
(downloaded from the middle of a forward stage where a backward stage starts inside one). So:

- for ``forward()`` (run types "infer" / "train"): the stage plan is ``fwd_plan`` (it covers
  every layer) and the backward plan is ``bwd_plan`` reversed (empty: the forward stages);
- for ``forward_backward()`` (run type "fused"): ``fwd_plan`` covers layers 0..T-1, the first
  backward stage is ``range(T, L)`` (the tail), the stage plan is ``fwd_plan`` followed by the
  tail and the backward plan is ``bwd_plan`` reversed.

Upstream's asymmetric examples (two forward stages and four backward ones) therefore run as
written. A model-level plan in the "train" form whose backward stages differ from its forward
ones cannot serve a ``forward_backward()`` call unless both end with the same stage (the engine
refuses that call with INVALID_ARGUMENT: the tail is the last stage of both); give such calls a
plan of their own.

A per-call plan (``RoundPipeRunConfig(execute_plan=plan)`` on one call) switches the engine's
plans for that call and back to the model's own at the next call without one;
``RoundPipe.set_stage_plan`` changes the model's own plan (and drops its backward plan). A
training ``forward()`` whose backward has not run yet keeps its plan: switching then raises
RoundPipeError (STATE) until ``loss.backward()`` has run.

A plan that breaks upstream's validation rules (layers not covered exactly once, forward not
ascending, backward not descending, the fused rule) raises :class:`RoundPipeError`
(INVALID_ARGUMENT) naming ``execute_plan`` and the offending entry.
"""

from typing import TYPE_CHECKING, List, NamedTuple, Optional, Sequence, Union

from .errors import RoundPipeError, Status

try:
    from typing import Literal
except ImportError:  # Python < 3.8
    from typing_extensions import Literal  # type: ignore

if TYPE_CHECKING:
    from .model import RoundPipe

__all__ = ["ModelExecutePlan"]


class EnginePlan(NamedTuple):
    """What the engine is given for a plan: layers per stage (``rp_model_set_stage_plan``) and
    layers per backward stage from layer 0 (``rp_model_set_backward_stage_plan``; None: the
    forward stages)."""
    forward: List[int]
    backward: Optional[List[int]] = None

RunType = Literal["infer", "train", "fused"]
_RUN_TYPES = ("infer", "train", "fused")


def _bad(message: str) -> RoundPipeError:
    return RoundPipeError(Status.INVALID_ARGUMENT, "execute_plan: " + message)


class ModelExecutePlan:
    """Execution plan of a RoundPipe model: which layers form each forward stage
    (``fwd_plan``) and each backward stage (``bwd_plan``), as lists of ``range``.

    Backward stages may differ from the forward ones (upstream's asymmetric partitioning); see
    the module documentation for how a plan maps onto the engine.
    """

    def __init__(self) -> None:
        self.fwd_plan: List[range] = []
        self.bwd_plan: List[range] = []

    def __repr__(self) -> str:
        return "ModelExecutePlan(fwd_plan=%r, bwd_plan=%r)" % (self.fwd_plan, self.bwd_plan)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelExecutePlan):
            return NotImplemented
        return list(self.fwd_plan) == list(other.fwd_plan) and \
            list(self.bwd_plan) == list(other.bwd_plan)

    __hash__ = None  # type: ignore[assignment]  # mutable

    # -- engine <-> upstream ------------------------------------------------------------------

    @classmethod
    def from_stage_plan(cls, layers_per_stage: Sequence[int], run_type: RunType = "fused",
                        backward_layers_per_stage: Optional[Sequence[int]] = None
                        ) -> "ModelExecutePlan":
        """The plan of run type `run_type` that the engine's stage plan `layers_per_stage`
        (``RoundPipe.stage_plan()``) and backward plan `backward_layers_per_stage`
        (``RoundPipe.backward_stage_plan()``; None: the same stages) run: "infer": the stages
        forward, no backward plan; "train": the stages forward, then the backward stages,
        deepest first; "fused": every stage but the last forward, then the backward stages from
        the last (the tail) down to the first."""
        _check_run_type(run_type)
        stages = _stage_ranges(layers_per_stage)
        backward = stages if backward_layers_per_stage is None \
            else _stage_ranges(backward_layers_per_stage)
        plan = cls()
        plan.fwd_plan = stages[:-1] if run_type == "fused" else list(stages)
        plan.bwd_plan = [] if run_type == "infer" else list(reversed(backward))
        return plan

    def stage_plan(self, num_layers: int, run_type: Optional[RunType] = None) -> EnginePlan:
        """The engine's stage plan and backward stage plan for this plan over `num_layers`
        layers.

        `run_type`: "fused" (a forward_backward() call), "infer" / "train" (a forward() call),
        or None (a model-level plan: either form). Raises RoundPipeError (INVALID_ARGUMENT) for
        a plan upstream rejects."""
        if run_type is not None:
            _check_run_type(run_type)
        fwd = _ranges(self.fwd_plan, "fwd_plan")
        bwd = _ranges(self.bwd_plan, "bwd_plan")
        covered = 0
        for i, r in enumerate(fwd):
            if r.start != covered:
                raise _bad("fwd_plan[%d] is %r: forward stages must be in ascending order, each "
                           "starting where the previous one stopped (at layer %d)"
                           % (i, r, covered))
            covered = r.stop
        if covered > num_layers:
            raise _bad("fwd_plan reaches layer %d, the model has %d layers"
                       % (covered - 1, num_layers))
        if bwd:
            top = num_layers
            for i, r in enumerate(bwd):
                if r.stop != top:
                    raise _bad("bwd_plan[%d] is %r: backward stages must be in descending "
                               "order, covering every layer once (expected a stage ending at "
                               "layer %d)" % (i, r, top - 1))
                top = r.start
            if top != 0:
                raise _bad("bwd_plan stops at layer %d: it must cover every layer down to 0"
                           % top)
        fused = covered < num_layers
        if fused and run_type in ("infer", "train"):
            raise _bad("fwd_plan covers layers 0..%d of %d: a forward() plan must cover every "
                       "layer" % (covered - 1, num_layers))
        if fused:
            if not bwd:
                raise _bad("fwd_plan covers layers 0..%d of %d and bwd_plan is empty: the "
                           "layers after the forward plan must be the first backward stage"
                           % (covered - 1, num_layers))
            if bwd[0].start != covered:
                raise _bad("bwd_plan[0] is %r: with forward_backward() the first backward "
                           "stage must start where fwd_plan stops (layer %d)"
                           % (bwd[0], covered))
            stages = fwd + [bwd[0]]
        else:
            if run_type == "fused":
                raise _bad("fwd_plan covers every layer: with forward_backward() the last "
                           "layers run only in the fused first backward stage, so fwd_plan "
                           "must stop where bwd_plan[0] starts")
            stages = fwd
        if not stages:
            raise _bad("the plan has no stage")
        forward = [len(r) for r in stages]
        if not bwd or list(reversed(bwd)) == stages:
            return EnginePlan(forward)
        return EnginePlan(forward, [len(r) for r in reversed(bwd)])

    def layers_per_stage_hint(self) -> EnginePlan:
        """Layers per stage before the model's layer count is known (a model-level plan):
        the plan checked as covering layers 0..N-1, N the highest layer it names + 1, in
        either form. The engine then checks N against the model (and check_model_plan
        repeats upstream's rules with the model's count)."""
        fwd = _ranges(self.fwd_plan, "fwd_plan")
        bwd = _ranges(self.bwd_plan, "bwd_plan")
        top = max([r.stop for r in fwd + bwd] or [0])
        if top == 0:
            raise _bad("the plan has no stage")
        return self.stage_plan(top)

    # -- auto -----------------------------------------------------------------------------------

    @classmethod
    def auto(cls, run_type: RunType, *models: "RoundPipe", min_stages: Optional[int] = None,
             upper_threshold: float = 1.1, model_memory_limit: Optional[float] = None
             ) -> Union["ModelExecutePlan", List["ModelExecutePlan"]]:
        """A plan for each model, in the form of `run_type` ("infer", "train" or "fused"); one
        model gives one plan, several a list (each planned on its own). The engine's planner
        decides the stages, from layer cost estimates and, on GPUs, the times measured in the
        first three training calls.

        With neither `min_stages` nor `model_memory_limit` given, this is the plan the model
        runs now (``rp_model_stage_plan``). With either, the planner makes a new one
        (``rp_model_plan_stages``; the model's own plan is left alone, so pass the result as an
        ``execute_plan``): stages whose weights and gradients (model dtype, plus workspaces)
        stay within `model_memory_limit` / 2 GiB each, as upstream (a stage is prefetched while
        another computes), and at least `min_stages` of them (at most one per layer). A layer
        alone over the limit raises RoundPipeError (INVALID_ARGUMENT) naming it.
        `upper_threshold` is a hint the planner does not take (it balances the stages' costs
        exactly)."""
        _check_run_type(run_type)
        if not models:
            raise RoundPipeError(Status.INVALID_ARGUMENT,
                                 "ModelExecutePlan.auto: give at least one RoundPipe model")
        from .model import RoundPipe
        for i, m in enumerate(models):
            if not isinstance(m, RoundPipe):
                raise RoundPipeError(Status.INVALID_ARGUMENT, "ModelExecutePlan.auto: models[%d] "
                                     "is a %s, not a RoundPipe" % (i, type(m).__name__))
        if min_stages is not None and (isinstance(min_stages, bool)
                                       or not isinstance(min_stages, int) or min_stages < 1):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "ModelExecutePlan.auto: min_stages "
                                 "must be an int >= 1, got %r" % (min_stages,))
        if isinstance(upper_threshold, bool) or not isinstance(upper_threshold, (int, float)) \
                or not upper_threshold >= 1.0:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "ModelExecutePlan.auto: "
                                 "upper_threshold must be a number >= 1, got %r"
                                 % (upper_threshold,))
        if model_memory_limit is not None and (
                isinstance(model_memory_limit, bool)
                or not isinstance(model_memory_limit, (int, float)) or not model_memory_limit > 0):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "ModelExecutePlan.auto: "
                                 "model_memory_limit must be a number of GB > 0, got %r"
                                 % (model_memory_limit,))
        plans = []
        for m in models:
            if min_stages is None and model_memory_limit is None:
                counts = m.stage_plan()
                backward = m.backward_stage_plan()
                plans.append(cls.from_stage_plan(counts, run_type,
                                                 None if backward == counts else backward))
                continue
            limit = 0 if model_memory_limit is None else \
                max(1, int(float(model_memory_limit) / 2 * 2 ** 30))
            counts = m._model.plan_stages(limit, min_stages or 0)
            plans.append(cls.from_stage_plan(counts, run_type, None))
        return plans[0] if len(plans) == 1 else plans


def _check_run_type(run_type: object) -> None:
    if run_type not in _RUN_TYPES:
        raise RoundPipeError(Status.INVALID_ARGUMENT, "run_type must be \"infer\", \"train\" "
                             "or \"fused\", got %r" % (run_type,))


def _stage_ranges(layers_per_stage: Sequence[int]) -> List[range]:
    stages, at = [], 0
    for n in layers_per_stage:
        stages.append(range(at, at + int(n)))
        at += int(n)
    return stages


def _ranges(value: object, name: str) -> List[range]:
    if not isinstance(value, (list, tuple)):
        raise _bad("%s must be a list of range, got %s" % (name, type(value).__name__))
    out = []
    for i, r in enumerate(value):
        if not isinstance(r, range) or r.step != 1 or len(r) == 0 or r.start < 0:
            raise _bad("%s[%d] must be a non-empty range(start, stop) of layer indices, got %r"
                       % (name, i, r))
        out.append(r)
    return out


def model_stage_plan(stage_plan: Optional[Sequence[int]],
                     execute_plan: Optional[ModelExecutePlan]) -> Optional[EnginePlan]:
    """The plans a model is built with: `stage_plan` (RoundPipe's own argument) or the
    model-level run configuration's `execute_plan` (both given: they must agree)."""
    if execute_plan is None:
        return None if stage_plan is None else EnginePlan([int(n) for n in stage_plan])
    plans = execute_plan.layers_per_stage_hint()
    if stage_plan is not None and list(stage_plan) != plans.forward:
        raise RoundPipeError(Status.INVALID_ARGUMENT, "stage_plan %r and the model_run_config's "
                             "execute_plan (%r layers per stage) disagree; give one"
                             % (list(stage_plan), plans.forward))
    return plans


def check_model_plan(model: "RoundPipe") -> None:
    """Upstream's validation of the model-level execute_plan, once the layer count is known."""
    plan = model.model_run_config.execute_plan
    if plan is not None:
        plan.stage_plan(model.num_layers)


def check_call_plan(model: "RoundPipe", run_config: Optional[object], run_type: RunType) -> None:
    """A per-call execute_plan must be valid for the call (`run_type`: "fused" for
    forward_backward(), "infer" for forward()); the engine switches to it for the call
    (``rp_model_set_stage_plan``, ``rp_model_set_backward_stage_plan``) and back to the model's
    own plans at the next call without one."""
    plan = getattr(run_config, "execute_plan", None)
    if plan is None:
        model._use_call_plan(None)
        return
    model._use_call_plan(plan.stage_plan(model.num_layers, run_type))
