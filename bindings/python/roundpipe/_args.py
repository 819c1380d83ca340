"""The user API's arguments as the engine's C values: dtypes, pin and host-memory modes, device
kinds, built-in losses. Each mapping is written here once; RoundPipe and
wrap_model_to_roundpipe validate through these before anything is built."""

import os
import sys
from collections import namedtuple

import torch

from . import _capi
from .errors import RoundPipeError, RoundPipeUnsupportedError, Status

_DTYPES = {
    torch.float32: _capi.RP_DTYPE_F32,
    torch.bfloat16: _capi.RP_DTYPE_BF16,
    torch.float16: _capi.RP_DTYPE_F16,
}
_PIN_MODES = {"alloc": _capi.RP_PIN_ALLOC, "register": _capi.RP_PIN_REGISTER,
              "off": _capi.RP_PIN_OFF}
_HOST_MEMORY_MODES = {"standard": _capi.RP_HOST_MEMORY_STANDARD,
                      "saving": _capi.RP_HOST_MEMORY_SAVING}
_DEVICE_KINDS = {"auto": _capi.RP_DEVICE_AUTO, "cpu": _capi.RP_DEVICE_CPU,
                 "cuda": _capi.RP_DEVICE_CUDA}
LOSSES = {"output": _capi.RP_LOSS_OUTPUT, "mse": _capi.RP_LOSS_MSE,
          "cross_entropy": _capi.RP_LOSS_CROSS_ENTROPY, "causal_lm": _capi.RP_LOSS_CAUSAL_LM}


class BuiltinLoss:
    """A loss computed inside the engine (no Python per microbatch): ``"output"`` (the model's
    output is the loss), ``"mse"`` (mean squared error against float labels of the output's
    shape), ``"cross_entropy"`` (mean cross entropy of logits [N, C] against int64 labels
    [N]) or ``"causal_lm"`` (for a model ending in an ``lm_head`` layer: token cross entropy
    against labels [batch, seq], -100 for no target, already the mean over the batch's targets);
    each computed per microbatch and multiplied by `scale` (use ``scale=1/num_microbatch`` for the
    mean over the whole batch, except with ``"causal_lm"``). A string works too:
    ``loss_fn="mse"`` is ``BuiltinLoss("mse")``."""

    def __init__(self, kind, scale=1.0):
        if kind not in LOSSES:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "unknown built-in loss %r; one of %s"
                                 % (kind, ", ".join(sorted(LOSSES))))
        self.kind = kind
        self.scale = float(scale)

    def __repr__(self):
        return "BuiltinLoss(%r, scale=%g)" % (self.kind, self.scale)


class HostStateBytes(namedtuple("HostStateBytes", ["bytes", "elements", "bytes_per_param"])):
    """What :meth:`RoundPipe.host_state_bytes` returns: ``bytes`` of host memory held by the
    model's parameter state (tensor bytes), ``elements`` the number of parameter elements (tied
    parameters once) and ``bytes_per_param`` their ratio (0.0 for a model without
    parameters)."""

    __slots__ = ()


def builtin_loss(loss_fn, label, return_outputs):
    """The BuiltinLoss `loss_fn` names, or None for a Python callable."""
    if loss_fn is None or isinstance(loss_fn, (str, BuiltinLoss)):
        builtin = loss_fn if isinstance(loss_fn, BuiltinLoss) else BuiltinLoss(loss_fn or "output")
        if builtin.kind == "causal_lm" and return_outputs:
            raise RoundPipeUnsupportedError(
                "return_outputs with the causal_lm loss: the LM head computes the loss "
                "chunk by chunk and never forms the logits; call forward() for logits, or "
                "pass a Python loss_fn, which receives them")
        # "output" (the default) ignores the label, as upstream's default loss_fn does
        if builtin.kind != "output" and label is not None and not isinstance(label, torch.Tensor):
            raise TypeError("with a built-in loss the label must be one tensor, got %s"
                            % type(label).__name__)
        return builtin
    if callable(loss_fn):
        return None
    raise TypeError("loss_fn must be None, a built-in loss name, a BuiltinLoss or a "
                    "callable; got %r" % (loss_fn,))


def parse_host_memory(host_memory):
    """The rp_host_memory_mode of a ``host_memory=`` argument; ValueError for anything else."""
    if not isinstance(host_memory, str) or host_memory not in _HOST_MEMORY_MODES:
        raise ValueError('host_memory must be "standard" or "saving", got %r' % (host_memory,))
    return _HOST_MEMORY_MODES[host_memory]


def parse_pin_model(pin_model):
    """The rp_pin_mode of a ``pin_model=`` argument."""
    if pin_model not in _PIN_MODES:
        raise RoundPipeError(Status.INVALID_ARGUMENT, 'pin_model must be "alloc", '
                             '"register" or "off", got %r' % (pin_model,))
    return _PIN_MODES[pin_model]


def parse_dtype(dtype, what):
    """The rp_dtype of a torch dtype (None stays None: the engine's default)."""
    if dtype is None:
        return None
    if dtype not in _DTYPES:
        raise RoundPipeError(Status.INVALID_ARGUMENT, "%s must be torch.float32, "
                             "torch.bfloat16 or torch.float16, got %s" % (what, dtype))
    return _DTYPES[dtype]


def parse_devices(devices):
    """(rp_device_kind, count) or None for the engine's default."""
    if devices is None:
        return None
    if isinstance(devices, bool):
        raise TypeError("devices must be a kind, a count or (kind, count)")
    if isinstance(devices, int):
        return (_capi.RP_DEVICE_AUTO, devices)
    if isinstance(devices, str):
        devices = (devices, 0)
    try:
        kind, count = devices
    except (TypeError, ValueError):
        raise TypeError('devices must be "auto", "cpu", "cuda", an int, or (kind, count); got %r'
                        % (devices,)) from None
    if kind not in _DEVICE_KINDS:
        raise RoundPipeError(Status.INVALID_ARGUMENT, 'device kind must be "auto", "cpu" or '
                             '"cuda", got %r' % (kind,))
    return (_DEVICE_KINDS[kind], int(count))


def parse_grad_scaler(grad_scaler):
    """(initial_scale, growth_interval), or None for the engine's default."""
    if grad_scaler is None:
        return None
    scale, interval = (0.0, 1) if grad_scaler is False else grad_scaler
    return (float(scale), int(interval))


def call_site_name():
    """Upstream's default name: "file.py:line" of the code that built the model."""
    frame = sys._getframe(1)
    here = os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.dirname(os.path.abspath(
            frame.f_code.co_filename)) == here:
        frame = frame.f_back
    if frame is None:
        return "roundpipe"
    return "%s:%d" % (os.path.basename(frame.f_code.co_filename), frame.f_lineno)
