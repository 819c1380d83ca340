"""RoundPipeRunConfig: how one call is cut into microbatches and how its outputs come back."""

import ctypes

import torch

from . import _capi
from ._capi import lib
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


def leaf_split_dim(spec, where):
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
        num_microbatch: number of microbatches (default: number of devices + 1).
        recompute_grain: ``"stage"`` (default) or ``"layer"``.
        output_device: where outputs are returned: None/``"cpu"`` (default) or a CUDA device.
        split_input: how inputs are split. None: tensors with dimensions along dim 0, 0-d
            tensors and Python scalars replicated. Or upstream's ``(args_spec, kwargs_spec)``
            pair, whose leaves are None (default rule), an int dimension,
            ``TensorChunkSpec(dim)`` or ``REPLICATE`` / ``_Replicate``. Or a function
            ``split(args, kwargs, num_microbatch) -> (args_list, kwargs_list)``.
        split_label: how labels are split: None (the default rule, applied to every tensor of
            a nested tuple/list/dict), a leaf spec as above, a nested spec matching the label's
            structure, or ``split(label, num_microbatch) -> list``. With a built-in loss the
            label must be one tensor and the spec a leaf.
        merge_output: None/True (concatenate along dim 0, average 0-d outputs), False (return a
            list with one output per microbatch), ``TensorChunkSpec(dim)`` (concatenate along
            `dim`), a ``_CustomReducer``, or a function ``merge(list_of_outputs)``.
    """

    _FIELDS = ("num_microbatch", "recompute_grain", "output_device", "split_input",
               "split_label", "merge_output")

    def __init__(self, num_microbatch=None, recompute_grain=None, output_device=None,
                 split_input=None, split_label=None, merge_output=None):
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
        _parse_output_device(output_device)  # validates
        self.num_microbatch = num_microbatch
        self.recompute_grain = recompute_grain
        self.output_device = output_device
        self.split_input = split_input
        self.split_label = split_label
        self.merge_output = merge_output

    def __repr__(self):
        fields = ", ".join("%s=%r" % (f, getattr(self, f)) for f in self._FIELDS
                           if getattr(self, f) is not None)
        return "RoundPipeRunConfig(%s)" % fields

    def overridden_by(self, other):
        """A new configuration: `other`'s fields where set, else this one's."""
        if other is None:
            return self
        merged = RoundPipeRunConfig()
        for f in self._FIELDS:
            value = getattr(other, f)
            setattr(merged, f, value if value is not None else getattr(self, f))
        return merged

    # -- helpers for the model ---------------------------------------------------------------

    def merge_mode(self):
        """1 when the engine should merge outputs, 0 when the binding gets per-microbatch
        outputs (and merges them itself unless merge_output is False)."""
        m = self.merge_output
        if m is None or m is True:
            return 1
        return 0

    def build_c(self, input_dims=None, label_dim=None, split_callback=None):
        """An owned C rp_run_config holding this configuration's engine-side fields.

        `input_dims`: per-input split dims (None entries leave the default); `label_dim`: label
        split dim or None; `split_callback`: (rp_split_fn, user_data) or None.
        """
        L = lib()
        handle = _capi.rp_run_config_p()
        L.rp_run_config_create(ctypes.byref(handle))
        try:
            if self.num_microbatch is not None:
                L.rp_run_config_set_num_microbatch(handle, self.num_microbatch)
            if self.recompute_grain is not None:
                L.rp_run_config_set_recompute_grain(handle, _GRAINS[self.recompute_grain])
            dev = _parse_output_device(self.output_device)
            if dev is not None:
                L.rp_run_config_set_output_device(handle, dev[0], dev[1])
            L.rp_run_config_set_merge_output(handle, self.merge_mode())
            for i, dim in enumerate(input_dims or ()):
                if dim is not None:
                    L.rp_run_config_set_input_split_dim(handle, i, dim)
            if label_dim is not None:
                L.rp_run_config_set_label_split_dim(handle, label_dim)
            if split_callback is not None:
                L.rp_run_config_set_split_callback(handle, split_callback[0],
                                                   split_callback[1])
        except BaseException:
            L.rp_run_config_destroy(handle)
            raise
        return handle
