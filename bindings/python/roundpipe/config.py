"""RoundPipeRunConfig: how one call is cut into microbatches and how its outputs come back."""

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch

try:
    from typing import Literal
except ImportError:  # Python < 3.8
    from typing_extensions import Literal  # type: ignore

if TYPE_CHECKING:
    from .execute_plan import ModelExecutePlan

from . import _capi
from .errors import RoundPipeError, Status


class _ReplicateMarker:
    """Spec leaf meaning: give every microbatch the whole value (upstream's ``_Replicate``)."""

    def __repr__(self):
        return "roundpipe.REPLICATE"


#: Split spec leaf: replicate this input or label to every microbatch.
REPLICATE = _ReplicateMarker()

_GRAINS = {"stage": _capi.RP_GRAIN_STAGE, "layer": _capi.RP_GRAIN_LAYER}


def _is_replicate(spec):
    """REPLICATE, or torch.distributed.pipelining's _Replicate (the class or an instance)."""
    if spec is REPLICATE:
        return True
    cls = spec if isinstance(spec, type) else type(spec)
    return cls.__name__ == "_Replicate"


def _is_chunk_spec(spec):
    """torch.distributed.pipelining's TensorChunkSpec (anything with an int ``split_dim``)."""
    return isinstance(getattr(spec, "split_dim", None), int)


def _is_reducer(spec):
    """torch.distributed.pipelining's _CustomReducer (``init_value`` + ``reduce_fn``)."""
    return hasattr(spec, "reduce_fn") and hasattr(spec, "init_value")


def leaf_split_dim(spec: Any, where: str) -> Optional[int]:
    """Split dimension of one spec leaf: None (default rule), an int >= 0, or
    RP_SPLIT_REPLICATE."""
    if spec is None:
        return None
    if _is_replicate(spec):
        return _capi.RP_SPLIT_REPLICATE
    if _is_chunk_spec(spec):
        dim = spec.split_dim
    elif isinstance(spec, int) and not isinstance(spec, bool):
        dim = spec
    else:
        raise TypeError("%s: a split spec leaf is None, an int dimension, "
                        "TensorChunkSpec(dim) or REPLICATE/_Replicate, got %r" % (where, spec))
    if dim < 0:
        raise RoundPipeError(Status.INVALID_ARGUMENT,
                             "%s: split dimension must be >= 0, got %d" % (where, dim))
    return dim


def _parse_output_device(device):
    """(DLDeviceType, index) for an output device."""
    if device is None:
        return None
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cpu":
        return (_capi.kDLCPU, 0)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else 0
        return (_capi.kDLCUDA, index)
    raise RoundPipeError(Status.INVALID_ARGUMENT,
                         "output_device must be the CPU or a CUDA device, got %s" % dev)


class RoundPipeRunConfig:
    """Run configuration, model-level (``RoundPipe(model_run_config=...)``) or per call.

    Every field defaults to None, meaning "not set here": a per-call configuration overrides
    the model-level one field by field, and fields set nowhere take the built-in defaults.

    Args:
        requires_grad: upstream's switch for autograd through ``forward()`` (default:
            ``torch.is_grad_enabled()``): True connects a training-mode forward's outputs to
            autograd even under ``torch.no_grad()``, False makes it an inference forward.
            ``forward_backward()`` always computes gradients.
        output_device: where outputs are returned: None/``"cpu"`` (default) or a CUDA device.
        preserve_rng_state: upstream's switch for replaying the RNG in recompute (default
            True). The engine always replays dropout in recompute from its seeded generator,
            so True is what it does; False is accepted and changes nothing.
        recompute_grain: ``"stage"`` (default) or ``"layer"``.
        num_microbatch: number of microbatches (default: number of devices + 1).
        split_input: how inputs are split. None: tensors with dimensions along dim 0, 0-d
            tensors and Python scalars replicated. Or upstream's ``(args_spec, kwargs_spec)``
            pair, whose leaves are None (default rule), an int dimension,
            ``TensorChunkSpec(dim)`` or ``REPLICATE`` / ``_Replicate``. Or a function
            ``split(args, kwargs, num_microbatch) -> (args_list, kwargs_list)``.
        split_label: how labels are split: None (the default rule, applied to every tensor of
            a nested tuple/list/dict), a leaf spec as above, a nested spec matching the label's
            structure, or ``split(label, num_microbatch) -> list``. With a built-in loss the
            label must be one tensor and the spec a leaf.
        merge_output: None/True (concatenate along dim 0, average 0-d outputs), False (every
            leaf of the output a :class:`RoundPipePackedData` with one value per microbatch,
            which another RoundPipe model takes as its input without splitting it again),
            ``TensorChunkSpec(dim)`` (concatenate along `dim`), a ``_CustomReducer``,
            ``_Replicate`` (every microbatch gave the same value), a nested tuple/list/dict of
            these matching the output's structure, or a function ``merge(list_of_outputs)``.
        execute_plan: a :class:`roundpipe.ModelExecutePlan`: which layers form each stage,
            forward and backward. A model-level plan is the model's own; a per-call plan
            switches the engine's plans for that call and back at the next call without one.
            See roundpipe.execute_plan.
    """

    _FIELDS = ("requires_grad", "output_device", "preserve_rng_state", "recompute_grain",
               "num_microbatch", "split_input", "split_label", "merge_output", "execute_plan")

    def __init__(
        self,
        requires_grad: Optional[bool] = None,
        output_device: Union[torch.device, str, None] = None,
        preserve_rng_state: Optional[bool] = None,
        recompute_grain: Optional[Literal["stage", "layer"]] = None,
        num_microbatch: Optional[int] = None,
        split_input: Union[
            Tuple[Optional[Tuple[Any, ...]], Optional[Dict[str, Any]]],
            Callable[[Tuple[Any, ...], Dict[str, Any], int],
                     Tuple[List[Tuple[Any, ...]], List[Dict[str, Any]]]],
            Any, None] = None,
        split_label: Union[Any, Callable[[Any, int], List[Any]], None] = None,
        merge_output: Union[Any, Callable[[List[Any]], Any], bool, None] = None,
        execute_plan: Optional["ModelExecutePlan"] = None,
    ) -> None:
        if num_microbatch is not None:
            if isinstance(num_microbatch, bool) or not isinstance(num_microbatch, int):
                raise TypeError("num_microbatch must be an int, got %r" % (num_microbatch,))
            if not 1 <= num_microbatch <= 65536:
                raise RoundPipeError(Status.INVALID_ARGUMENT,
                                     "num_microbatch must be in 1..65536, got %d"
                                     % num_microbatch)
        if recompute_grain is not None and recompute_grain not in _GRAINS:
            raise RoundPipeError(Status.INVALID_ARGUMENT,
                                 'recompute_grain must be "stage" or "layer", got %r'
                                 % (recompute_grain,))
        for flag, value in (("requires_grad", requires_grad),
                            ("preserve_rng_state", preserve_rng_state)):
            if value is not None and not isinstance(value, bool):
                raise RoundPipeError(Status.INVALID_ARGUMENT,
                                     "%s must be None or a bool, got %r" % (flag, value))
        if execute_plan is not None:
            from .execute_plan import ModelExecutePlan
            if not isinstance(execute_plan, ModelExecutePlan):
                raise RoundPipeError(Status.INVALID_ARGUMENT,
                                     "execute_plan must be a roundpipe.ModelExecutePlan or "
                                     "None, got %s" % type(execute_plan).__name__)
        _parse_output_device(output_device)  # validates
        self.requires_grad = requires_grad
        self.output_device = output_device
        self.preserve_rng_state = preserve_rng_state
        self.recompute_grain = recompute_grain
        self.num_microbatch = num_microbatch
        self.split_input = split_input
        self.split_label = split_label
        self.merge_output = merge_output
        self.execute_plan = execute_plan

    def __repr__(self) -> str:
        fields = ", ".join("%s=%r" % (f, getattr(self, f)) for f in self._FIELDS
                           if getattr(self, f) is not None)
        return "RoundPipeRunConfig(%s)" % fields

    # -- what goes where ---------------------------------------------------------------------
    # The engine holds num_microbatch, recompute_grain, output_device and the merge rules it
    # knows (True / False, TensorChunkSpec(0)), overlays a call's over the model's and fills in
    # its defaults (rp_model_resolve_run_config). The split specs and the custom merges are
    # Python objects the engine cannot hold: their overlay is here, in call_fields().

    def engine_fields(self) -> Dict[str, Any]:
        """The fields this configuration sets that the engine holds, as C values (keyword
        arguments of ``_internals.RunConfig.build``)."""
        return {"num_microbatch": self.num_microbatch,
                "recompute_grain": _GRAINS.get(self.recompute_grain),
                "output_device": _parse_output_device(self.output_device),
                "merge_output": engine_merge(self.merge_output)}

    def call_fields(self, call: Optional["RoundPipeRunConfig"]) -> "RoundPipeRunConfig":
        """A configuration with only the Python-side fields a call uses, `call`'s where set,
        else this (model-level) one's: split_input, split_label, requires_grad,
        preserve_rng_state, merge_output when it is a merge the engine does not do (else None),
        and execute_plan as the call itself gives it (the model-level plan is the engine's)."""
        def pick(field):
            value = getattr(call, field) if call is not None else None
            return value if value is not None else getattr(self, field)
        merge = pick("merge_output")
        return RoundPipeRunConfig(split_input=pick("split_input"),
                                  split_label=pick("split_label"),
                                  requires_grad=pick("requires_grad"),
                                  preserve_rng_state=pick("preserve_rng_state"),
                                  merge_output=merge if is_custom_merge(merge) else None,
                                  execute_plan=call.execute_plan if call is not None else None)


def engine_merge(merge: Any) -> Optional[int]:
    """rp_run_config_set_merge_output's value for a merge_output: 1 or 0 when the engine does
    the merge asked for (True, False, TensorChunkSpec(0)), None when unset or custom."""
    if merge is True or merge is False:
        return int(merge)
    if _is_chunk_spec(merge) and merge.split_dim == 0:
        return 1
    return None


def is_custom_merge(merge: Any) -> bool:
    """A merge_output the binding does itself: a function, a _CustomReducer or a
    TensorChunkSpec along a dimension other than 0."""
    return merge is not None and engine_merge(merge) is None
