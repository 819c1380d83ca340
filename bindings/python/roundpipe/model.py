"""RoundPipe: upstream's model API over libroundpipe."""

import atexit
import functools
import json
import os
import sys
import threading
import weakref
from collections import OrderedDict, namedtuple
from ctypes import byref, c_char_p, c_double, c_int32, c_int64, c_size_t, c_void_p

import torch
from torch import nn

from . import _capi
from ._callbacks import (LOSS_TRAMPOLINE, SPLIT_TRAMPOLINE, STEP_TRAMPOLINE, LossCall, SplitCall,
                         StepCall, in_library_thread, park_handle, registry, release_parked)
from ._capi import lib
from ._dlpack import BorrowedInputs, from_owned
from .config import (RoundPipeRunConfig, _is_chunk_spec, _is_reducer, _is_replicate,
                     leaf_split_dim)
from .convert import resolve_model
from .errors import RoundPipeError, RoundPipeUnsupportedError, Status
from .hf import hf_inputs, hf_name, module_weights
from .optim import BuiltinOptimizer

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
_LOSSES = {"output": _capi.RP_LOSS_OUTPUT, "mse": _capi.RP_LOSS_MSE,
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
        if kind not in _LOSSES:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "unknown built-in loss %r; one of %s"
                                 % (kind, ", ".join(sorted(_LOSSES))))
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


def _parse_host_memory(host_memory):
    """The rp_host_memory_mode of a ``host_memory=`` argument; ValueError for anything else."""
    if not isinstance(host_memory, str) or host_memory not in _HOST_MEMORY_MODES:
        raise ValueError('host_memory must be "standard" or "saving", got %r' % (host_memory,))
    return _HOST_MEMORY_MODES[host_memory]


class RoundPipePackedData(list):
    """Per-microbatch outputs (``merge_output=False``). A list; ``synchronize()`` is there for
    upstream compatibility and does nothing (outputs are complete when the call returns)."""

    def synchronize(self):
        return self


def _parse_devices(devices):
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


def _call_site_name():
    """Upstream's default name: "file.py:line" of the code that built the model."""
    frame = sys._getframe(1)
    here = os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.dirname(os.path.abspath(
            frame.f_code.co_filename)) == here:
        frame = frame.f_back
    if frame is None:
        return "roundpipe"
    return "%s:%d" % (os.path.basename(frame.f_code.co_filename), frame.f_lineno)


def _as_input(x, where):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (bool, int, float)):
        return torch.tensor(x)
    raise TypeError("%s: inputs must be tensors or Python numbers, got %s"
                    % (where, type(x).__name__))


class _Params:
    """The optimizer-facing parameters of one model: torch Parameters over the engine's master
    weights, whose .grad is wired to the engine's gradients (inside a step function: that
    step's gradients; after synchronize(): the accumulated ones). When the engine's gradient
    buffer has another dtype than the master weight (bf16 gradients of a bf16 / fp16 model with
    host_memory="saving"), .grad is a copy in the master's dtype, since torch.optim requires
    a gradient of its parameter's dtype."""

    def __init__(self, model_ptr):
        self.model_ptr = model_ptr
        self.items = None
        self.lock = threading.Lock()
        self.sync_grads = False  # grads attached by synchronize() (no step can be running)
        self.step_exc = None

    def build(self, model_ptr=None):
        with self.lock:
            if self.items is not None:
                return self.items
            L = lib()
            ptr = model_ptr or self.model_ptr
            count = c_size_t()
            L.rp_param_count(byref(count), ptr)
            items = []
            for i in range(count.value):
                name = c_char_p()
                L.rp_param_name(byref(name), ptr, i)
                out = c_void_p()
                L.rp_param_master(byref(out), ptr, i)
                master = from_owned(out.value)
                items.append((name.value.decode(), nn.Parameter(master, requires_grad=True)))
            self.items = items
            return items

    def attach_grads(self, model_ptr):
        """.grad of every parameter := a fresh view of the engine's gradient."""
        L = lib()
        for i, (_, p) in enumerate(self.build(model_ptr)):
            out = c_void_p()
            L.rp_param_grad(byref(out), model_ptr, i)
            grad = from_owned(out.value)
            p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)

    def detach_grads(self):
        if self.items is not None:
            for _, p in self.items:
                p.grad = None

    def record_step_exception(self, exc):
        if self.step_exc is None:
            self.step_exc = exc


_live_models = weakref.WeakSet()


@atexit.register
def _close_live_models():
    # Before the interpreter tears down: a model draining at finalization could wait for a
    # Python step function that can no longer take the GIL.
    for model in list(_live_models):
        try:
            model.close()
        except Exception:
            pass
    release_parked()


class RoundPipe:
    """A model trained by the RoundPipe engine.

    Args:
        model: what to run: a JSON layer spec (dict, list of layer dicts, JSON text or path of a
            .json file; see docs/semantics.md); an ``nn.Sequential`` of supported modules (its
            weights are copied); a transformers ``Qwen3ForCausalLM`` / ``LlamaForCausalLM``
            (built from its config, weights copied); a Hugging Face model directory
            (config.json and safetensors weights; config.json alone gives random weights); or a
            Hugging Face config (dict or JSON text with "architectures", or a transformers
            config object; random weights). Causal LMs take input_ids, attention_mask and
            position_ids, return logits and train with ``loss_fn="causal_lm"``.
        optim_dtype: dtype of master weights and optimizer state (torch.float32 (default),
            torch.bfloat16 or torch.float16).
        name: shown in logs; default "file.py:line" of the caller.
        model_run_config: model-level RoundPipeRunConfig.
        pin_model: "alloc" (default), "register" or "off": how host weights are pinned.
        model_dtype: dtype the devices compute with (default: the module's parameter dtype;
            for a Hugging Face directory or config its "dtype" entry, as transformers'
            from_pretrained reads it; else float32).
        devices: which workers run the stages: "auto" (default: every GPU, else one CPU
            worker), "cpu", "cuda", an int count, or (kind, count) such as ("cpu", 2) for two
            CPU worker devices.
        seed: seed of weight initialisation and dropout (default 0).
        stage_plan: explicit list of layers per stage (default: automatic).
        gpu_memory_cap: bytes of GPU memory the model may use per GPU (default: 80% of free).
        grad_scaler: dynamic loss scaling as ``(initial_scale, growth_interval)``, ``False`` to
            turn it off (default: on for float16 models, off otherwise).
        host_memory: host memory layout of the per-parameter state (``rp_host_memory_mode``):
            ``"standard"`` (default): 24 bytes per parameter for bf16 / fp16 models, 28 for
            fp32 ones (fp32 master, fp32 AdamW moments, two fp32 gradient buffers, two
            model-dtype weight copies), so an asynchronous step overlaps the whole next call
            and its weights are one step stale. ``"saving"``: 12 bytes per parameter (fp32
            master, built-in AdamW moments / SGD momentum in bf16 with stochastic rounding, one
            gradient buffer: bf16, fp32 for fp32 models, and one model-dtype weight copy, none
            for fp32 models); steps still overlap the next call, layer by layer, and weights
            are never stale. The memory saving is the built-in optimizers'
            (``step(roundpipe.optim.AdamW(...))``): a Python ``step_fn`` with a torch.optim
            optimizer sees fp32 copies of bf16 gradients (torch.optim needs gradients of the
            parameters' dtype), made for the step, and keeps its own fp32 state.
            :meth:`host_state_bytes` reports what the model holds. Any other value raises
            ValueError before anything is built.
    """

    def __init__(self, model, optim_dtype=None, name=None, model_run_config=None,
                 pin_model="alloc", *, model_dtype=None, devices=None, seed=None,
                 stage_plan=None, gpu_memory_cap=None, grad_scaler=None,
                 host_memory="standard"):
        self._handle = None  # first: close() and __del__ must work if __init__ fails
        self._params = None
        if name is None:
            name = _call_site_name()
        if model_run_config is None:
            model_run_config = RoundPipeRunConfig()
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError("model_run_config must be a RoundPipeRunConfig")
        if pin_model not in _PIN_MODES:
            raise RoundPipeError(Status.INVALID_ARGUMENT, 'pin_model must be "alloc", '
                                 '"register" or "off", got %r' % (pin_model,))
        host_memory_mode = _parse_host_memory(host_memory)
        source = resolve_model(model)
        if model_dtype is None:
            model_dtype = source.dtype
        for what, dt in (("model_dtype", model_dtype), ("optim_dtype", optim_dtype)):
            if dt is not None and dt not in _DTYPES:
                raise RoundPipeError(Status.INVALID_ARGUMENT, "%s must be torch.float32, "
                                     "torch.bfloat16 or torch.float16, got %s" % (what, dt))
        devs = _parse_devices(devices)

        L = lib()
        options = _capi.rp_model_options_p()
        L.rp_model_options_create(byref(options))
        c_config = None
        try:
            if model_dtype is not None:
                L.rp_model_options_set_model_dtype(options, _DTYPES[model_dtype])
            if optim_dtype is not None:
                L.rp_model_options_set_optim_dtype(options, _DTYPES[optim_dtype])
            L.rp_model_options_set_pin_mode(options, _PIN_MODES[pin_model])
            L.rp_model_options_set_host_memory_mode(options, host_memory_mode)
            if seed is not None:
                L.rp_model_options_set_seed(options, int(seed))
            L.rp_model_options_set_name(options, str(name).encode())
            if devs is not None:
                L.rp_model_options_set_devices(options, devs[0], devs[1])
            if gpu_memory_cap is not None:
                L.rp_model_options_set_gpu_memory_cap(options, int(gpu_memory_cap))
            if grad_scaler is not None:
                scale, interval = (0.0, 1) if grad_scaler is False else grad_scaler
                L.rp_model_options_set_grad_scaler(options, float(scale), int(interval))
            if stage_plan is not None:
                plan = [int(n) for n in stage_plan]
                L.rp_model_options_set_stage_plan(options, (c_int32 * max(1, len(plan)))(*plan),
                                                  len(plan))
            # The engine gets the model-level fields it understands; the binding applies the
            # Python-only ones (callables, nested specs) itself at every call.
            c_config = RoundPipeRunConfig(
                num_microbatch=model_run_config.num_microbatch,
                recompute_grain=model_run_config.recompute_grain,
                output_device=model_run_config.output_device).build_c()
            L.rp_model_options_set_run_config(options, c_config)
            handle = _capi.rp_model_p()
            if source.kind == "hf_dir":
                L.rp_model_create_from_hf(byref(handle), os.fsencode(source.path), options)
            elif source.kind == "hf_config":
                L.rp_model_create_from_hf_config(byref(handle), source.text.encode(), options)
            else:
                L.rp_model_create(byref(handle), source.text.encode(), options)
        finally:
            if c_config is not None:
                L.rp_run_config_destroy(c_config)
            L.rp_model_options_destroy(options)
        self._handle = handle
        self._name = str(name)
        self._run_config = model_run_config
        self._host_memory = host_memory
        self._params = _Params(handle.value)
        count = c_int32()
        L.rp_model_num_devices(byref(count), handle)
        self._num_devices = count.value
        self.training = True
        self.model = model if isinstance(model, nn.Module) else None
        self._original_model = self.model
        self._hf_config = source.config if source.is_hf else None
        self._module_names = None
        _live_models.add(self)
        try:
            weights = None
            if source.converted is not None:
                weights = source.converted.params
            elif source.module is not None:
                weights = module_weights(source.module, self._param_shapes(),
                                         self._num_hidden_layers,
                                         bool(self._hf_config.get("tie_word_embeddings")))
            if weights is not None:
                self._copy_in([(engine_name, p) for engine_name, p, _ in weights])
        except BaseException:
            self.close()
            raise
        if weights is not None:
            self._module_names = {engine_name: mod_name for engine_name, _, mod_name in weights}

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def handle(self):
        """The ``rp_model *`` (ctypes); RoundPipeError once closed."""
        if self._handle is None:
            raise RoundPipeError(Status.STATE, "this RoundPipe model was closed")
        release_parked()
        return self._handle

    def close(self):
        """Destroy the engine model (waits for work in flight). Idempotent. Parameters taken
        before stay valid tensors."""
        handle, self._handle = self._handle, None
        if handle is not None and handle.value:
            _live_models.discard(self)
            if in_library_thread():
                # Destroying waits for this very thread: leave it to the driving thread.
                park_handle(handle, lib().rp_model_destroy)
            else:
                lib().rp_model_destroy(handle)
        release_parked()

    @property
    def closed(self):
        return self._handle is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._handle is None:
            return "<RoundPipe %r (closed)>" % getattr(self, "_name", "?")
        return "<RoundPipe %r: %d layers, %d stages, %d devices>" % (
            self._name, self.num_layers, self.num_stages, self.num_devices)

    def __getattr__(self, name):
        # Upstream forwards unknown attributes to the original model (e.g. `config`).
        if name.startswith("_"):
            raise AttributeError(name)
        target = self.__dict__.get("_original_model")
        if target is None:
            raise AttributeError("'RoundPipe' object has no attribute %r" % name)
        return getattr(target, name)

    def _forwards(self, name):
        """Whether setting / deleting attribute `name` goes to the original model: names that
        RoundPipe itself has (its own attributes, methods, properties, private names) stay."""
        return (not name.startswith("_") and name not in self.__dict__
                and not hasattr(type(self), name)
                and self.__dict__.get("_original_model") is not None)

    def __setattr__(self, name, value):
        if self._forwards(name):
            setattr(self.__dict__["_original_model"], name, value)
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if self._forwards(name):
            delattr(self.__dict__["_original_model"], name)
        else:
            object.__delattr__(self, name)

    def set_original_model(self, original_model):
        """Attributes RoundPipe does not have are read from, written to and deleted on
        `original_model` (wrap_model_to_roundpipe sets it, so that e.g. ``model.config`` of a
        wrapped transformers model works)."""
        self._original_model = original_model

    # -- facts --------------------------------------------------------------------------------

    def _count(self, fn, ctype=c_int32):
        out = ctype()
        fn(byref(out), self.handle)
        return out.value

    @property
    def name(self):
        return self._name

    @property
    def num_layers(self):
        return self._count(lib().rp_model_num_layers)

    @property
    def num_stages(self):
        return self._count(lib().rp_model_num_stages)

    @property
    def num_devices(self):
        return self._count(lib().rp_model_num_devices)

    @property
    def step_count(self):
        """Optimizer steps enqueued so far."""
        return self._count(lib().rp_model_step_count, c_int64)

    @property
    def grad_scale(self):
        """``(scale, skipped_steps)`` of dynamic loss scaling (scale 0: off)."""
        scale, skipped = c_double(), c_int64()
        lib().rp_model_grad_scale(byref(scale), byref(skipped), self.handle)
        return scale.value, skipped.value

    @property
    def gpu_memory_cap(self):
        """GPU memory cap in bytes (0 on CPU devices)."""
        return self._count(lib().rp_model_gpu_memory_cap, c_int64)

    @property
    def host_memory(self):
        """The host memory mode the model was built with: "standard" or "saving"."""
        return self._host_memory

    def host_state_bytes(self):
        """Host memory held by the model's parameter state (``rp_model_host_state_bytes``), as
        a :class:`HostStateBytes` ``(bytes, elements, bytes_per_param)``: master weights,
        weight copies the devices read, gradient buffers and built-in optimizer state (which
        exists from the first built-in step on), counted as tensor bytes without allocator
        padding, over the number of parameter elements (tied parameters once). After a
        built-in AdamW step a bf16 model holds 24 bytes per parameter in standard mode and 12
        in saving mode (28 and 12 for fp32 models). State of a Python optimizer and the
        binding's gradient copies are not counted."""
        out_bytes, out_elements = c_int64(), c_int64()
        lib().rp_model_host_state_bytes(byref(out_bytes), byref(out_elements), self.handle)
        n_bytes, n_elements = out_bytes.value, out_elements.value
        return HostStateBytes(n_bytes, n_elements,
                              n_bytes / n_elements if n_elements else 0.0)

    def trace(self):
        """Timing record of the last call, as a Chrome trace dict (``rp_model_trace_json``)."""
        text = c_char_p()
        lib().rp_model_trace_json(byref(text), self.handle)
        return json.loads(text.value.decode())

    @property
    def model_run_config(self):
        return self._run_config

    @property
    def _num_hidden_layers(self):
        # A causal LM is token_embedding, the decoder layers, rms_norm, lm_head.
        return self.num_layers - 3

    def _param_shapes(self):
        return [(name, tuple(p.shape)) for name, p in self._params.build()]

    def train(self, mode=True):
        """For upstream compatibility: forward() always runs in evaluation mode (dropout off),
        forward_backward() in training mode."""
        self.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- calls --------------------------------------------------------------------------------

    def _inputs(self, args, kwargs, cfg):
        """(tensors, per-input split dims, SplitCall or None) for one call."""
        if self._hf_config is not None:  # input_ids, attention_mask, position_ids, in order
            args, kwargs = hf_inputs(args, kwargs)
        args = tuple(args)
        kwargs = dict(kwargs or {})
        keys = list(kwargs)

        def flatten(a, k):
            a = tuple(a)
            k = dict(k or {})
            if len(a) != len(args) or list(k) != keys:
                raise ValueError("a microbatch must have the call's structure: %d positional "
                                 "arguments and keywords %s" % (len(args), keys))
            return [_as_input(x, "argument %d" % i) for i, x in enumerate(a)] + \
                [_as_input(k[key], "keyword %r" % key) for key in keys]

        tensors = flatten(args, kwargs)
        if not tensors:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "the model needs at least one input")
        spec = cfg.split_input
        dims = None
        split_call = None
        if spec is None:
            pass
        elif callable(spec) and not _is_chunk_spec(spec) and not _is_replicate(spec):
            split_call = SplitCall(spec, args, kwargs, flatten)
        elif (isinstance(spec, (tuple, list)) and len(spec) == 2
              and (spec[0] is None or isinstance(spec[0], (tuple, list)))
              and (spec[1] is None or isinstance(spec[1], dict))):
            args_spec = tuple(spec[0]) if spec[0] is not None else (None,) * len(args)
            kwargs_spec = spec[1] or {}
            if len(args_spec) != len(args):
                raise RoundPipeError(Status.INVALID_ARGUMENT, "split_input has %d args specs for "
                                     "%d positional arguments" % (len(args_spec), len(args)))
            unknown = set(kwargs_spec) - set(keys)
            if unknown:
                raise RoundPipeError(Status.INVALID_ARGUMENT, "split_input names keywords the "
                                     "call does not have: %s" % sorted(unknown))
            dims = [leaf_split_dim(s, "split_input args[%d]" % i) for i, s in enumerate(args_spec)]
            dims += [leaf_split_dim(kwargs_spec.get(k), "split_input kwargs[%r]" % k)
                     for k in keys]
        elif isinstance(spec, (tuple, list)):
            if len(spec) != len(tensors):
                raise RoundPipeError(Status.INVALID_ARGUMENT, "split_input has %d specs for %d "
                                     "inputs" % (len(spec), len(tensors)))
            dims = [leaf_split_dim(s, "split_input[%d]" % i) for i, s in enumerate(spec)]
        else:
            dim = leaf_split_dim(spec, "split_input")
            dims = [dim] * len(tensors)
        return tensors, dims, split_call

    def _num_microbatch(self, cfg):
        return cfg.num_microbatch if cfg.num_microbatch is not None else self._num_devices + 1

    def _outputs(self, out_list, cfg):
        """Torch tensors from an rp_tensor_list (which this destroys), merged as `cfg` says."""
        L = lib()
        try:
            size = c_size_t()
            L.rp_tensor_list_size(byref(size), out_list)
            tensors = []
            for i in range(size.value):
                ptr = c_void_p()
                L.rp_tensor_list_get(byref(ptr), out_list, i)
                tensors.append(from_owned(ptr.value))
        finally:
            L.rp_tensor_list_destroy(out_list)
        merge = cfg.merge_output
        if merge is None or merge is True:
            return tensors[0] if len(tensors) == 1 else tensors
        if merge is False:
            return RoundPipePackedData(tensors)
        if _is_reducer(merge):
            return functools.reduce(merge.reduce_fn, tensors, merge.init_value)
        if _is_chunk_spec(merge):
            return torch.cat(tensors, dim=merge.split_dim)
        if callable(merge):
            return merge(tensors)
        raise TypeError("merge_output must be None, a bool, TensorChunkSpec, _CustomReducer or a "
                        "function; got %r" % (merge,))

    @staticmethod
    def _raise_call_failure(failure, *calls):
        """Raise the user's own exception when a callback of the call failed, else `failure`."""
        if failure.status == Status.CALLBACK:
            for call in calls:
                exc = getattr(call, "exc", None) if call is not None else None
                if exc is not None:
                    call.exc = None
                    raise exc
        raise failure

    def forward(self, *args, roundpipe_run_config=None, **kwargs):
        """Inference: split the inputs into microbatches, run them through the pipeline on the
        published weights without gradients (dropout off), merge the outputs."""
        cfg = self._run_config.overridden_by(roundpipe_run_config)
        tensors, dims, split_call = self._inputs(args, kwargs, cfg)
        L = lib()
        key = registry.add(split_call) if split_call is not None else None
        c_config = cfg.build_c(dims, None, (SPLIT_TRAMPOLINE, key) if key else None)
        failure = None
        out_list = _capi.rp_tensor_list_p()
        try:
            inputs = BorrowedInputs(tensors)
            L.rp_forward(byref(out_list), self.handle, inputs.array, inputs.count, c_config)
        except RoundPipeError as err:
            failure = err
        finally:
            L.rp_run_config_destroy(c_config)
            if key is not None:
                registry.pop(key)
        if failure is not None:
            self._raise_call_failure(failure, split_call)
        return self._outputs(out_list, cfg)

    __call__ = forward

    def _split_label(self, label, spec, n):
        """Per-microbatch labels for a Python loss_fn, after upstream's rules."""
        if spec is not None and callable(spec) and not _is_chunk_spec(spec) \
                and not _is_replicate(spec):
            pieces = list(spec(label, n))
            if len(pieces) != n:
                raise ValueError("split_label function returned %d pieces for %d microbatches"
                                 % (len(pieces), n))
            return pieces
        if isinstance(label, torch.Tensor):
            dim = leaf_split_dim(spec, "split_label") if not isinstance(spec, (tuple, list, dict)) \
                else _bad_label_spec(spec)
            if dim == _capi.RP_SPLIT_REPLICATE or (dim is None and label.dim() == 0):
                return [label] * n
            dim = dim or 0
            if dim >= label.dim() or label.shape[dim] < n:
                raise RoundPipeError(
                    Status.INVALID_ARGUMENT,
                    "label of shape %s cannot be split into %d microbatches along dim %d"
                    % (tuple(label.shape), n, dim))
            return list(torch.tensor_split(label, n, dim))
        if isinstance(label, (tuple, list)):
            specs = spec if isinstance(spec, (tuple, list)) else [spec] * len(label)
            if len(specs) != len(label):
                raise RoundPipeError(Status.INVALID_ARGUMENT, "split_label spec has %d entries "
                                     "for a label of %d" % (len(specs), len(label)))
            columns = [self._split_label(x, s, n) for x, s in zip(label, specs)]
            return [type(label)(col[m] for col in columns) if isinstance(label, tuple) else
                    [col[m] for col in columns] for m in range(n)]
        if isinstance(label, dict):
            specs = spec if isinstance(spec, dict) else {k: spec for k in label}
            columns = {k: self._split_label(v, specs.get(k), n) for k, v in label.items()}
            return [{k: columns[k][m] for k in label} for m in range(n)]
        return [label] * n  # None and other objects go whole to every microbatch

    def forward_backward(self, input_args=(), input_kwargs=None, label=None, loss_fn=None,
                         return_outputs=False, run_config=None):
        """Training: forward, loss and backward of every microbatch in one pipelined pass.

        Gradients are added to the accumulated gradients (consumed by the next step()).

        Args:
            input_args: positional inputs (a tuple; a single tensor is accepted too).
            input_kwargs: keyword inputs (travel with the first input; the engine's layers
                consume input 0). A causal LM takes ``input_ids``, ``attention_mask`` and
                ``position_ids``, positionally or by keyword.
            label: labels, split like the inputs (see RoundPipeRunConfig.split_label); for a
                causal LM, token ids [batch, seq] shaped like input_ids, -100 for no target
                (token t is scored against label t + 1, as transformers' ``labels=``).
            loss_fn: None or "output" (the output is the loss; for a causal LM given a label,
                None means "causal_lm"), "mse", "cross_entropy", "causal_lm" (the mean token
                cross entropy over the batch's targets, fused into the LM head), a
                BuiltinLoss, or a Python callable ``loss_fn(outputs, labels) -> loss tensor``
                (or a sequence of loss tensors) called once per microbatch with that
                microbatch's outputs (a fresh fp32 CPU tensor) and labels; the binding
                back-propagates through it with torch autograd. Exceptions it raises abort the
                call and are re-raised here; the model stays usable and no gradient of the call
                is kept.
            return_outputs: also return the merged outputs (not with "causal_lm", which
                never forms the logits).
            run_config: per-call RoundPipeRunConfig.

        Returns:
            the sum of the microbatch losses (0-d float64 tensor), or (loss, outputs).
        """
        if isinstance(input_args, torch.Tensor):
            input_args = (input_args,)
        cfg = self._run_config.overridden_by(run_config)
        tensors, dims, split_call = self._inputs(input_args, input_kwargs, cfg)
        L = lib()
        if loss_fn is None and label is not None and self._hf_config is not None:
            loss_fn = "causal_lm"

        loss_call = None
        label_tensor = None
        label_dim = None
        if loss_fn is None or isinstance(loss_fn, (str, BuiltinLoss)):
            builtin = loss_fn if isinstance(loss_fn, BuiltinLoss) else BuiltinLoss(loss_fn or
                                                                                    "output")
            if builtin.kind == "causal_lm" and return_outputs:
                raise RoundPipeUnsupportedError(
                    "return_outputs with the causal_lm loss: the LM head computes the loss "
                    "chunk by chunk and never forms the logits; call forward() for logits, or "
                    "pass a Python loss_fn, which receives them")
            if label is not None:
                if not isinstance(label, torch.Tensor):
                    raise TypeError("with a built-in loss the label must be one tensor, got %s"
                                    % type(label).__name__)
                label_tensor = label
                spec = cfg.split_label
                if spec is not None and callable(spec) and not _is_chunk_spec(spec) \
                        and not _is_replicate(spec):
                    raise TypeError("a split_label function needs a Python loss_fn")
                label_dim = leaf_split_dim(spec, "split_label")
            loss = _capi.rp_loss_p()
            L.rp_loss_create(byref(loss), _LOSSES[builtin.kind])
            try:
                L.rp_loss_set_scale(loss, builtin.scale)
            except BaseException:
                L.rp_loss_destroy(loss)
                raise
        elif callable(loss_fn):
            labels = None
            if label is not None:
                labels = self._split_label(label, cfg.split_label, self._num_microbatch(cfg))
            loss_call = LossCall(loss_fn, labels)
            loss = _capi.rp_loss_p()
            loss_key = registry.add(loss_call)
            try:
                L.rp_loss_create_callback(byref(loss), LOSS_TRAMPOLINE, loss_key)
            except BaseException:
                registry.pop(loss_key)
                raise
        else:
            raise TypeError("loss_fn must be None, a built-in loss name, a BuiltinLoss or a "
                            "callable; got %r" % (loss_fn,))

        split_key = registry.add(split_call) if split_call is not None else None
        failure = None
        out_loss = c_double()
        out_list = _capi.rp_tensor_list_p()
        c_config = None
        try:
            c_config = cfg.build_c(dims, label_dim,
                                   (SPLIT_TRAMPOLINE, split_key) if split_key else None)
            inputs = BorrowedInputs(tensors)
            labels_in = BorrowedInputs([label_tensor]) if label_tensor is not None else None
            L.rp_forward_backward(byref(out_loss), byref(out_list) if return_outputs else None,
                                  self.handle, inputs.array, inputs.count,
                                  labels_in.pointers[0] if labels_in else None, loss, c_config)
        except RoundPipeError as err:
            failure = err
        finally:
            if c_config is not None:
                L.rp_run_config_destroy(c_config)
            L.rp_loss_destroy(loss)
            if loss_call is not None:
                registry.pop(loss_key)
            if split_key is not None:
                registry.pop(split_key)
        if failure is not None:
            self._raise_call_failure(failure, loss_call, split_call)
        loss_value = torch.tensor(out_loss.value, dtype=torch.float64)
        if return_outputs:
            return loss_value, self._outputs(out_list, cfg)
        return loss_value

    # -- optimizer ----------------------------------------------------------------------------

    def optim_named_parameters(self, prefix="", remove_duplicate=True):
        """(name, Parameter) for every parameter: torch Parameters sharing memory with the
        engine's master weights (fp32 unless optim_dtype says otherwise). Inside a step
        function their .grad is that step's gradient; after synchronize() it is the gradient
        accumulated since the last step. Read or write them only inside a step function or
        after synchronize(). Names are "<layer>.<name>" ("0.weight"). A gradient whose engine
        dtype differs from the parameter's (bf16 gradients with ``host_memory="saving"``) is
        given as a copy in the parameter's dtype: a view otherwise."""
        self.handle  # raises when closed
        for name, p in self._params.build():
            yield (prefix + "." + name if prefix else name), p

    def optim_parameters(self):
        """The Parameters of optim_named_parameters(), for a torch.optim optimizer."""
        for _, p in self.optim_named_parameters():
            yield p

    # The engine keeps one host copy that Python can reach: the master weights. parameters()
    # gives the same Parameters (upstream redirects them to the optimizer copy inside step_fn).
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """Same as optim_named_parameters(): the latest weights after synchronize()."""
        return self.optim_named_parameters(prefix, remove_duplicate)

    def parameters(self, recurse=True):
        return self.optim_parameters()

    def _raise_step_failure(self, failure):
        if failure.status == Status.CALLBACK and self._params.step_exc is not None:
            exc, self._params.step_exc = self._params.step_exc, None
            raise exc
        raise failure

    def step(self, step_fn, is_async=True, *args, **kwargs):
        """One optimizer step over the gradients accumulated since the previous one.

        `step_fn` is either a built-in optimizer's settings (roundpipe.optim.AdamW / SGD: the
        update runs in C++), or a Python callable ``step_fn(*args, **kwargs)`` run on the
        optimizer thread with optim_parameters()' .grad set to this step's gradients, e.g.
        ``lambda: (opt.step(), opt.zero_grad())`` for a torch.optim optimizer over
        optim_parameters(); it must update the parameters in place. With
        ``host_memory="saving"`` the gradients of a bf16 / fp16 model are bf16 in the engine
        and .grad is an fp32 copy of them (writes to it do not reach the engine); a built-in
        optimizer is the memory-saving path there (bf16 moments, no copies).

        Async (default): returns at once; the next forward_backward runs on the weights from
        before this step (staleness one). An exception raised by an async step_fn is re-raised
        by the next step() or synchronize(). Sync: returns when the new weights are in use, and
        re-raises step_fn's exception itself.
        """
        handle = self.handle
        L = lib()
        params = self._params
        if params.sync_grads:  # nothing runs since synchronize(): safe to drop its grad views
            params.detach_grads()
            params.sync_grads = False
        failure = None
        if isinstance(step_fn, BuiltinOptimizer):
            if args or kwargs:
                raise TypeError("a built-in optimizer takes no step arguments")
            try:
                L.rp_step(handle, step_fn.handle, int(bool(is_async)))
            except RoundPipeError as err:
                failure = err
        elif callable(step_fn):
            key = registry.add(StepCall(params, step_fn, args, kwargs))
            try:
                L.rp_step_callback(handle, STEP_TRAMPOLINE, key, int(bool(is_async)))
            except RoundPipeError as err:
                registry.pop(key)  # not enqueued (a sync step that ran popped it already)
                failure = err
        else:
            raise TypeError("step_fn must be a callable or a roundpipe.optim optimizer")
        if failure is not None:
            self._raise_step_failure(failure)

    def synchronize(self):
        """Wait for every pending step and publish the latest weights. Afterwards the
        parameters show the latest master weights and their .grad the gradients accumulated
        since the last step. Re-raises the exception of a failed async step_fn."""
        handle = self.handle
        try:
            lib().rp_synchronize(handle)
        except RoundPipeError as err:
            self._raise_step_failure(err)
        self._params.attach_grads(handle.value)
        self._params.sync_grads = True

    def zero_grad(self, set_to_none=True):
        """Drop the gradients accumulated since the last step."""
        handle = self.handle
        lib().rp_zero_grad(handle)
        if self._params.sync_grads and self._params.items is not None:
            self._params.attach_grads(handle.value)

    # -- weights ------------------------------------------------------------------------------

    def _copy_in(self, named):
        """Write (engine name, tensor) pairs into the master weights and publish them."""
        self.synchronize()
        params = dict(self._params.build())
        with torch.no_grad():
            for name, value in named:
                params[name].copy_(value.detach().to(device="cpu"))
        self.synchronize()

    def state_dict(self):
        """Copies of the latest weights (synchronizes first), by engine parameter name."""
        self.synchronize()
        return OrderedDict((name, p.detach().clone()) for name, p in self._params.build())

    def load_state_dict(self, state_dict, strict=True):
        """Copy weights into the model by engine parameter name (synchronizes before and
        after). With strict, every parameter must be given and nothing else."""
        params = dict(self._params.build())
        unexpected = [k for k in state_dict if k not in params]
        missing = [k for k in params if k not in state_dict]
        if strict and (unexpected or missing):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "load_state_dict: missing %s, "
                                 "unexpected %s" % (missing, unexpected))
        for k, v in state_dict.items():
            if k in params and tuple(v.shape) != tuple(params[k].shape):
                raise RoundPipeError(Status.INVALID_ARGUMENT, "load_state_dict: %s has shape %s,"
                                     " the model's is %s" % (k, tuple(v.shape),
                                                             tuple(params[k].shape)))
        self._copy_in([(k, v) for k, v in state_dict.items() if k in params])

    def copy_to_module(self, module=None):
        """Copy the latest weights into the nn.Module this model was built from (or `module`,
        which must have the same structure; for a causal LM, a transformers model of the same
        architecture and sizes). Returns the module."""
        module = module if module is not None else self.model
        names = self._module_names
        if names is None and self._hf_config is not None and module is not None:
            names = {name: hf_name(name, self._num_hidden_layers)
                     for name, _ in self._param_shapes()}
        if module is None or names is None:
            raise RoundPipeError(Status.STATE, "copy_to_module needs a model built from an "
                                 "nn.Module, or a module to copy into")
        targets = dict(module.named_parameters())
        missing = [names[k] for k in names if names[k] not in targets]
        if missing:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "copy_to_module: the module has no "
                                 "parameter %s" % ", ".join(missing))
        with torch.no_grad():
            for name, value in self.state_dict().items():
                target = targets[names[name]]
                target.copy_(value.to(target.dtype))
        return module

    def save_pretrained(self, save_directory, safe_serialization=True):
        """Save a causal LM as a Hugging Face directory that transformers' from_pretrained
        loads: config.json (its "dtype" set to the model dtype) and the latest weights
        (synchronizes first) in the model dtype under Hugging Face names, in the file layout of
        the checkpoint it was loaded from (one model.safetensors, or the same shards and index).
        The directory is created if missing (its parent must exist); tokenizer files are not
        written. Only for models built from a Hugging Face model, directory or config."""
        if not safe_serialization:
            raise RoundPipeUnsupportedError("save_pretrained writes safetensors only "
                                            "(safe_serialization=True)")
        if self._hf_config is None:
            raise RoundPipeError(Status.STATE, "save_pretrained needs a model built from a "
                                 "Hugging Face model, directory or config; use save(path)")
        lib().rp_model_save_hf(self.handle, os.fsencode(os.fspath(save_directory)))

    def load_pretrained(self, directory):
        """Load the weights of a Hugging Face directory (model.safetensors or sharded, with
        this model's architecture and sizes; its config.json is not read) into a causal LM.
        Every tensor is checked before any weight changes. Synchronizes first; optimizer state
        is kept, accumulated gradients are dropped; later save_pretrained calls use the file
        layout of `directory`."""
        if self._hf_config is None:
            raise RoundPipeError(Status.STATE, "load_pretrained needs a model built from a "
                                 "Hugging Face model, directory or config; use load(path)")
        handle = self.handle
        lib().rp_model_load_hf(handle, os.fsencode(os.fspath(directory)))
        if self._params.sync_grads and self._params.items is not None:
            self._params.attach_grads(handle.value)

    def hf_parameter_name(self, name):
        """The Hugging Face tensor name of engine parameter `name` of a causal LM
        ("1.self_attn.q_proj.weight" -> "model.layers.0.self_attn.q_proj.weight")."""
        if self._hf_config is None:
            raise RoundPipeError(Status.STATE, "not a model built from a Hugging Face config")
        return hf_name(name, self._num_hidden_layers)

    def save(self, path):
        """Save the latest weights (model dtype, engine names) as safetensors."""
        lib().rp_model_save(self.handle, os.fsencode(os.fspath(path)))

    def load(self, path):
        """Load every parameter from a safetensors file (drops accumulated gradients)."""
        handle = self.handle
        lib().rp_model_load(handle, os.fsencode(os.fspath(path)))
        if self._params.sync_grads and self._params.items is not None:
            self._params.attach_grads(handle.value)


def _bad_label_spec(spec):
    raise RoundPipeError(Status.INVALID_ARGUMENT, "split_label %r is nested but the label is "
                         "one tensor" % (spec,))


def spec_json(model):
    """The JSON layer spec RoundPipe(model) would build (for inspection). Hugging Face models
    are built by the engine from their config (docs/semantics.md has the layer list)."""
    source = resolve_model(model)
    if source.is_hf:
        raise RoundPipeUnsupportedError("a Hugging Face model is built by the engine from its "
                                        "config.json; it has no JSON layer spec here")
    return json.loads(source.text)
