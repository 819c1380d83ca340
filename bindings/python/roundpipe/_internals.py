"""Handle owners: the middle layer between the raw declarations (:mod:`roundpipe._capi`) and the
user's API (:mod:`roundpipe.model`), as llama-cpp-python's ``_internals.py`` sits between
``llama_cpp.py`` and ``llama.py``.

Each class here owns exactly one C handle and translates between Python values and the calls on
it, nothing more. Ownership is written once, in :class:`Owned`, from the handle table
``_DESTROY`` (one close, one finalizer, one context manager for every handle type): ``close()``
is idempotent, ``with`` closes, ``__del__`` closes what was forgotten. What the engine decides
(defaults, the microbatch split, the stage plan, Hugging Face names) is asked for through its
queries, never re-derived here.
"""

import atexit
import ctypes
import os
import threading
import weakref
from ctypes import POINTER, byref, c_char_p, c_double, c_int32, c_int64, c_size_t, c_void_p

from torch import nn

from . import _capi
from ._callbacks import (LOSS_TRAMPOLINE, SPLIT_TRAMPOLINE, STEP_TRAMPOLINE, in_library_thread,
                         park_handle, progress_scope, registry, release_parked)
from ._capi import DLManagedTensor, lib
from ._dlpack import BorrowedInputs, delete_owned, from_owned
from .errors import RoundPipeError, Status

#: The handle table: every owned handle type and the function that frees it.
_DESTROY = {
    _capi.rp_run_config_p: "rp_run_config_destroy",
    _capi.rp_model_options_p: "rp_model_options_destroy",
    _capi.rp_model_p: "rp_model_destroy",
    _capi.rp_tensor_list_p: "rp_tensor_list_destroy",
    _capi.rp_loss_p: "rp_loss_destroy",
    _capi.rp_optimizer_p: "rp_optimizer_destroy",
    _capi.rp_layer_def_p: "rp_layer_def_destroy",
}


def query(fn, *args, ctype=c_int32):
    """``fn(&out, *args)`` for a call with one scalar out-parameter; returns ``out``."""
    out = ctype()
    fn(byref(out), *args)
    return out.value


class Owned:
    """Owns one C handle of type ``_ctype`` (a key of ``_DESTROY``).

    ``Owned(create, *args)`` owns the handle ``create(&handle, *args)`` made: an rp_*_create, or
    any call whose first parameter receives a new handle of this type. :meth:`adopt` owns one a
    call already returned.
    """

    _ctype = None
    _what = "handle"

    def __init__(self, create, *args):
        self._handle = None  # first: close() and __del__ work if `create` fails
        handle = self._ctype()
        create(byref(handle), *args)
        self._handle = handle

    @classmethod
    def adopt(cls, handle):
        owner = cls.__new__(cls)
        owner._handle = handle
        return owner

    @property
    def handle(self):
        """The C handle (ctypes); raises once closed."""
        if self._handle is None:
            raise self._closed_error()
        return self._handle

    @property
    def closed(self):
        return self._handle is None

    def _closed_error(self):
        return RoundPipeError(Status.STATE, "this %s was closed" % self._what)

    def _destroy(self, handle):
        getattr(lib(), _DESTROY[type(handle)])(handle)

    def close(self):
        """Free the handle. Idempotent."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None and handle.value:
            self._destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ------------------------------------------------------------------------------------------------
# Run configuration, model options, losses, optimizer settings
# ------------------------------------------------------------------------------------------------


class RunConfig(Owned):
    """An ``rp_run_config``: the engine's fields of a run configuration (C values)."""

    _ctype = _capi.rp_run_config_p
    _what = "run configuration"

    @classmethod
    def build(cls, num_microbatch=None, recompute_grain=None, output_device=None,
              merge_output=None, input_dims=(), label_dim=None, split_callback=None):
        """A configuration setting what is not None: `recompute_grain` an rp_recompute_grain,
        `output_device` (DLDeviceType, index), `merge_output` 1 or 0, `input_dims` per-input
        split dims (None entries unset), `split_callback` (rp_split_fn, user_data)."""
        L = lib()
        config = cls(L.rp_run_config_create)
        try:
            h = config.handle
            if num_microbatch is not None:
                L.rp_run_config_set_num_microbatch(h, num_microbatch)
            if recompute_grain is not None:
                L.rp_run_config_set_recompute_grain(h, recompute_grain)
            if output_device is not None:
                L.rp_run_config_set_output_device(h, output_device[0], output_device[1])
            if merge_output is not None:
                L.rp_run_config_set_merge_output(h, merge_output)
            for i, dim in enumerate(input_dims or ()):
                if dim is not None:
                    L.rp_run_config_set_input_split_dim(h, i, dim)
            if label_dim is not None:
                L.rp_run_config_set_label_split_dim(h, label_dim)
            if split_callback is not None:
                L.rp_run_config_set_split_callback(h, split_callback[0], split_callback[1])
        except BaseException:
            config.close()
            raise
        return config

    @property
    def num_microbatch(self):
        """Number of microbatches (0: unset)."""
        return query(lib().rp_run_config_get_num_microbatch, self.handle)

    @property
    def recompute_grain(self):
        """An rp_recompute_grain (RP_GRAIN_DEFAULT: unset)."""
        return query(lib().rp_run_config_get_recompute_grain, self.handle)

    @property
    def output_device(self):
        """(DLDeviceType, index), or None when unset."""
        kind, index = c_int32(), c_int32()
        lib().rp_run_config_get_output_device(byref(kind), byref(index), self.handle)
        return (kind.value, index.value) if kind.value else None

    @property
    def merge_output(self):
        """1 merge, 0 one output per microbatch, -1 unset."""
        return query(lib().rp_run_config_get_merge_output, self.handle)


class ModelOptions(Owned):
    """An ``rp_model_options`` with every value given that is not None (C values: dtypes,
    modes and kinds as the header's enums; `devices` (kind, count); `grad_scaler` (scale,
    interval); `stage_plan` layers per stage; `run_config` a :class:`RunConfig`, copied by the
    engine; `data_parallel` (rank, world_size, rendezvous bytes, timeout_ms, global_loss),
    :meth:`roundpipe.DataParallel.engine_values`)."""

    _ctype = _capi.rp_model_options_p
    _what = "model options"

    def __init__(self, model_dtype=None, optim_dtype=None, pin_mode=None, host_memory_mode=None,
                 seed=None, name=None, devices=None, gpu_memory_cap=None, grad_scaler=None,
                 stage_plan=None, run_config=None, skip_nonfinite_steps=None,
                 data_parallel=None, lora=None):
        L = lib()
        super().__init__(L.rp_model_options_create)
        h = self.handle
        try:
            for setter, value in ((L.rp_model_options_set_model_dtype, model_dtype),
                                  (L.rp_model_options_set_optim_dtype, optim_dtype),
                                  (L.rp_model_options_set_pin_mode, pin_mode),
                                  (L.rp_model_options_set_host_memory_mode, host_memory_mode),
                                  (L.rp_model_options_set_seed, seed),
                                  (L.rp_model_options_set_skip_nonfinite_steps,
                                   skip_nonfinite_steps),
                                  (L.rp_model_options_set_gpu_memory_cap, gpu_memory_cap)):
                if value is not None:
                    setter(h, int(value))
            if name is not None:
                L.rp_model_options_set_name(h, name.encode())
            if devices is not None:
                L.rp_model_options_set_devices(h, devices[0], devices[1])
            if grad_scaler is not None:
                L.rp_model_options_set_grad_scaler(h, grad_scaler[0], grad_scaler[1])
            if stage_plan is not None:
                stage_plan = [int(n) for n in stage_plan]
                plan = (c_int32 * max(1, len(stage_plan)))(*stage_plan)
                L.rp_model_options_set_stage_plan(h, plan, len(stage_plan))
            if run_config is not None:
                L.rp_model_options_set_run_config(h, run_config.handle)
            if data_parallel is not None:
                rank, world_size, rendezvous, timeout_ms, global_loss = data_parallel
                L.rp_model_options_set_data_parallel(h, rank, world_size, rendezvous,
                                                     timeout_ms)
                L.rp_model_options_set_global_loss(h, global_loss)
            if lora is not None:
                rank, alpha, dropout, targets = lora
                L.rp_model_options_set_lora(h, rank, alpha, dropout, targets)
        except BaseException:
            self.close()
            raise


class Loss(Owned):
    """An ``rp_loss``: built-in (:meth:`builtin`) or a Python callback (:meth:`callback`)."""

    _ctype = _capi.rp_loss_p
    _what = "loss"

    @classmethod
    def builtin(cls, kind, scale):
        """Built-in loss `kind` (an rp_loss_kind) times `scale`."""
        loss = cls(lib().rp_loss_create, kind)
        try:
            lib().rp_loss_set_scale(loss.handle, scale)
        except BaseException:
            loss.close()
            raise
        return loss

    @classmethod
    def callback(cls, key):
        """The loss computed by the LossCall registered under `key`."""
        return cls(lib().rp_loss_create_callback, LOSS_TRAMPOLINE, key)

    @classmethod
    def device_callback(cls, key):
        """The loss computed on the device by the DeviceLossCall registered under `key`."""
        from ._device_loss import DEVICE_LOSS_TRAMPOLINE
        return cls(lib().rp_loss_create_device_callback, DEVICE_LOSS_TRAMPOLINE, key)


class LayerDef(Owned):
    """An ``rp_layer_def``: a caller-defined layer's callbacks, parameters and buffers."""

    _ctype = _capi.rp_layer_def_p
    _what = "layer declaration"

    def __init__(self, type_name, forward, backward, release, key):
        missing = _capi.missing_layer_api()
        if missing:
            raise RoundPipeError(Status.STATE, missing)
        super().__init__(lib().rp_layer_def_create, type_name.encode(), forward, backward,
                         release, key)

    def add_param(self, name, tensor, trainable):
        """Declare a parameter; its value is copied from `tensor` now."""
        lent = BorrowedInputs([tensor])
        lib().rp_layer_def_add_param(self.handle, name.encode(), lent.pointers[0],
                                     int(bool(trainable)))

    def add_tied_param(self, name, tied_to):
        """A parameter shared with an earlier layer's (its engine name `tied_to`)."""
        lib().rp_layer_def_add_tied_param(self.handle, name.encode(), tied_to.encode())

    def add_buffer(self, name, tensor):
        lent = BorrowedInputs([tensor])
        lib().rp_layer_def_add_buffer(self.handle, name.encode(), lent.pointers[0])


class Optimizer(Owned):
    """An ``rp_optimizer``: settings of a built-in optimizer (state lives in the model)."""

    _ctype = _capi.rp_optimizer_p
    _what = "optimizer settings object"

    def __init__(self, kind):
        super().__init__(lib().rp_optimizer_create, kind)

    def _closed_error(self):
        return ValueError("this optimizer settings object was closed")

    def set(self, setter, *values):
        """``rp_optimizer_set_<setter>(handle, *values)``; the engine validates."""
        getattr(lib(), "rp_optimizer_set_" + setter)(self.handle, *values)


# ------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------


class TensorList(Owned):
    """An ``rp_tensor_list`` (outputs of a call, or the pieces of a split)."""

    _ctype = _capi.rp_tensor_list_p
    _what = "tensor list"

    def pointers(self):
        """A new DLManagedTensor* for every tensor (each the caller's to release)."""
        L = lib()
        out = []
        for i in range(query(L.rp_tensor_list_size, self.handle, ctype=c_size_t)):
            ptr = c_void_p()
            L.rp_tensor_list_get(byref(ptr), self.handle, i)
            out.append(ptr.value)
        return out

    def to_torch(self):
        """The tensors as torch tensors (zero-copy); closes the list."""
        with self:
            return [from_owned(ptr) for ptr in self.pointers()]


def split_microbatches(tensor, dim, num_microbatch):
    """The engine's split of one tensor into `num_microbatch` pieces (``rp_split_microbatches``:
    `dim` >= 0 or RP_SPLIT_REPLICATE), as torch views of `tensor`.

    The engine's pieces are views of memory it borrows, valid only while `tensor` lives; each is
    re-expressed as the same view of `tensor` (its shape, strides and offset, through
    ``as_strided``), so that it keeps `tensor` alive as any torch view does."""
    source = tensor if tensor.is_contiguous() else tensor.contiguous()
    lent = BorrowedInputs([source])
    with TensorList(lib().rp_split_microbatches, lent.pointers[0], dim, num_microbatch) as lst:
        return [_view_of(source, ptr) for ptr in lst.pointers()]


def _view_of(source, ptr):
    """The view of `source` that the DLManagedTensor* `ptr` (released here) describes."""
    try:
        dl = ctypes.cast(ptr, POINTER(DLManagedTensor)).contents.dl_tensor
        shape = [dl.shape[i] for i in range(dl.ndim)]
        if dl.strides:
            strides = [dl.strides[i] for i in range(dl.ndim)]
        else:  # compact row-major
            strides, step = [], 1
            for size in reversed(shape):
                strides.insert(0, step)
                step *= max(size, 1)
        offset = source.storage_offset()
        if source.numel() and all(shape):
            offset += ((dl.data or 0) + dl.byte_offset - source.data_ptr()) \
                // source.element_size()
        return source.as_strided(shape, strides, offset)
    finally:
        delete_owned(ptr)


# ------------------------------------------------------------------------------------------------
# One call
# ------------------------------------------------------------------------------------------------


class CallScope:
    """What one forward / forward_backward holds while C runs: its C objects (run
    configurations, loss) and the registry entries of its Python callbacks, all released on
    exit whatever happened."""

    def __init__(self):
        self._owned, self._keys, self._calls = [], [], []

    def own(self, owner):
        self._owned.append(owner)
        return owner

    def register(self, call):
        """Register a Python callback call; returns its key (the C user_data)."""
        key = registry.add(call)
        self._keys.append(key)
        self._calls.append(call)
        return key

    def split_callback(self, split_call):
        """(rp_split_fn, user_data) for a SplitCall, or None."""
        return (SPLIT_TRAMPOLINE, self.register(split_call)) if split_call is not None else None

    def watch(self, call):
        """Report `call`'s kept exception (``.exc``) if the C call fails with
        RP_ERR_CALLBACK, as for registered calls."""
        self._calls.append(call)
        return call

    def run(self, fn, *args):
        """fn(*args); when a callback of this call failed, raise the user's own exception."""
        try:
            return fn(*args)
        except RoundPipeError as err:
            failure = err
        if failure.status == Status.CALLBACK:
            for call in self._calls:
                exc, call.exc = call.exc, None
                if exc is not None:
                    raise exc
        raise failure

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for owner in reversed(self._owned):
            owner.close()
        for key in self._keys:
            registry.pop(key)


# ------------------------------------------------------------------------------------------------
# Parameters (views of the engine's master weights and gradients)
# ------------------------------------------------------------------------------------------------


class Params:
    """The optimizer-facing parameters of one model: torch Parameters over the engine's master
    weights, whose .grad is wired to the engine's gradients (inside a step function: that
    step's gradients; after synchronize(): the accumulated ones). When the engine's gradient
    buffer has another dtype than the master weight (bf16 gradients of a bf16 / fp16 model with
    host_memory="saving"), .grad is a copy in the master's dtype, since torch.optim requires
    a gradient of its parameter's dtype. Model pointers are bare (step callbacks get one)."""

    def __init__(self, model_ptr):
        self.model_ptr = model_ptr
        self.items = None  # (name, Parameter) of trainable and frozen parameters
        self.buffers = None  # (name, tensor) of buffers (state that is not trained)
        self.trainable = None  # per item: has a gradient
        self.indices = None  # per item: its engine tensor index
        self.lock = threading.Lock()
        self.sync_grads = False  # grads attached by synchronize() (no step can be running)
        self.step_exc = None

    def build(self, model_ptr=None):
        with self.lock:
            if self.items is not None:
                return self.items
            L = lib()
            ptr = model_ptr or self.model_ptr
            items, buffers, trainable, indices = [], [], [], []
            for i in range(query(L.rp_param_count, ptr, ctype=c_size_t)):
                name = query(L.rp_param_name, ptr, i, ctype=c_char_p).decode()
                kind = param_kind(ptr, i)
                master = from_owned(query(L.rp_param_master, ptr, i, ctype=c_void_p))
                if kind == _capi.RP_PARAM_BUFFER:
                    buffers.append((name, master))
                    continue
                train = kind == _capi.RP_PARAM_TRAINABLE
                items.append((name, nn.Parameter(master, requires_grad=train)))
                trainable.append(train)
                indices.append(i)
            self.buffers, self.trainable, self.indices = buffers, trainable, indices
            self.items = items
            return items

    def attach_grads(self, model_ptr):
        """.grad of every parameter := a fresh view of the engine's gradient, or None where it
        received none (no call reached the parameter), as torch autograd leaves it: torch.optim
        then leaves the parameter alone, as the built-in optimizers do."""
        items = self.build(model_ptr)
        for (_, p), train, i in zip(items, self.trainable, self.indices):
            if not train:
                continue  # frozen: no gradient exists
            grad = grad_or_none(model_ptr, i)
            p.grad = grad if grad is None or grad.dtype == p.dtype else grad.to(p.dtype)

    def reattach_grads(self, model_ptr):
        """After the engine replaced its gradients outside a step (zero_grad, load): refresh
        the .grad views that synchronize() attached."""
        if self.sync_grads and self.items is not None:
            self.attach_grads(model_ptr)

    def detach_grads(self):
        if self.items is not None:
            for _, p in self.items:
                p.grad = None

    def record_step_exception(self, exc):
        if self.step_exc is None:
            self.step_exc = exc


def grad_or_none(model_ptr, index):
    """A view of the engine's gradient of tensor `index`, or None where it received nothing
    (``rp_param_grad_received``: inside a step function, that step's; elsewhere, since the last
    step), as autograd leaves a parameter the backward did not reach. Asked before the view is
    taken, since a view taken outside a step counts as a gradient. Always a view for a library
    from before the query."""
    L = lib()
    if hasattr(L, "rp_param_grad_received") and \
            not query(L.rp_param_grad_received, model_ptr, index, ctype=c_int32):
        return None
    return from_owned(query(L.rp_param_grad, model_ptr, index, ctype=c_void_p))


def param_kind(model_ptr, index):
    """The rp_param_kind of tensor `index` (every tensor is trainable for a library from before
    parameter kinds)."""
    if not hasattr(lib(), "rp_param_kind_of"):
        return _capi.RP_PARAM_TRAINABLE
    return query(lib().rp_param_kind_of, model_ptr, index)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------

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


class Model(Owned):
    """An ``rp_model``, built from a :class:`~roundpipe.convert.ModelSource` with
    :class:`ModelOptions`. Closing it on a library thread (a step callback dropping the last
    reference) leaves the destruction to the thread driving models, since destroying waits for
    that very thread."""

    _ctype = _capi.rp_model_p
    _what = "RoundPipe model"

    def __init__(self, source, options):
        L = lib()
        if source.kind == "hf_dir":
            with progress_scope():
                super().__init__(L.rp_model_create_from_hf, os.fsencode(source.path),
                                 options.handle)
        elif source.kind == "hf_config":
            super().__init__(L.rp_model_create_from_hf_config, source.text.encode(),
                             options.handle)
        elif source.layer_defs:
            defs = (_capi.rp_layer_def_p * len(source.layer_defs))(
                *[d.handle for d in source.layer_defs])
            super().__init__(L.rp_model_create_with_layers, source.text.encode(), defs,
                             len(source.layer_defs), options.handle)
        else:
            super().__init__(L.rp_model_create, source.text.encode(), options.handle)
        _live_models.add(self)

    @property
    def handle(self):
        handle = super().handle
        release_parked()
        return handle

    def _destroy(self, handle):
        if in_library_thread():
            park_handle(handle, lib().rp_model_destroy)
        else:
            lib().rp_model_destroy(handle)

    def close(self):
        """Destroy the model (waits for work in flight). Idempotent."""
        _live_models.discard(self)
        super().close()
        release_parked()

    # -- queries ----------------------------------------------------------------------------

    def count(self, name, ctype=c_int32):
        """``rp_model_<name>(&out, model)``: num_layers, num_stages, num_devices, step_count,
        gpu_memory_cap."""
        return query(getattr(lib(), "rp_model_" + name), self.handle, ctype=ctype)

    def grad_scale(self):
        scale, skipped = c_double(), c_int64()
        lib().rp_model_grad_scale(byref(scale), byref(skipped), self.handle)
        return scale.value, skipped.value

    def nonfinite_counts(self):
        losses, skipped = c_int64(), c_int64()
        lib().rp_model_nonfinite_counts(byref(losses), byref(skipped), self.handle)
        return losses.value, skipped.value

    def host_state_bytes(self):
        n_bytes, n_elements = c_int64(), c_int64()
        lib().rp_model_host_state_bytes(byref(n_bytes), byref(n_elements), self.handle)
        return n_bytes.value, n_elements.value

    def data_parallel(self):
        """(rank, world_size) the engine joined with (``rp_model_data_parallel``; 0 and 1
        without data parallelism)."""
        rank, world_size = c_int32(), c_int32()
        lib().rp_model_data_parallel(byref(rank), byref(world_size), self.handle)
        return rank.value, world_size.value

    def lora(self):
        """(rank, alpha, dropout, target modules text) of the model's adapters
        (``rp_model_lora``; rank 0: none)."""
        rank, alpha, dropout, targets = c_int32(), c_double(), c_double(), c_char_p()
        lib().rp_model_lora(byref(rank), byref(alpha), byref(dropout), byref(targets),
                            self.handle.value)
        return rank.value, alpha.value, dropout.value, (targets.value or b"").decode()

    def trace_json(self):
        return query(lib().rp_model_trace_json, self.handle, ctype=c_char_p).decode()

    def stage_plan(self):
        """Layers per stage of the current plan (``rp_model_stage_plan``)."""
        return self._read_plan(lib().rp_model_stage_plan)

    def backward_stage_plan(self):
        """Layers per backward stage in force (``rp_model_backward_stage_plan``)."""
        return self._read_plan(lib().rp_model_backward_stage_plan)

    def plan_stages(self, max_stage_bytes, min_stages):
        """``rp_model_plan_stages``: the planner's stages under a per-stage byte limit (0: none)
        and a least stage count, the model's own plan left alone."""
        n = c_int32()
        counts = (c_int32 * max(1, self.count("num_layers")))()
        lib().rp_model_plan_stages(counts, byref(n), len(counts), self.handle,
                                   int(max_stage_bytes), int(min_stages))
        return list(counts[:n.value])

    def _read_plan(self, query):
        n = c_int32()
        query(None, byref(n), 0, self.handle)
        counts = (c_int32 * max(1, n.value))()
        query(counts, byref(n), len(counts), self.handle)
        return list(counts[:n.value])

    def set_stage_plan(self, counts):
        """``rp_model_set_stage_plan``: layers per stage (empty: the automatic planner)."""
        self._write_plan(lib().rp_model_set_stage_plan, counts)

    def set_backward_stage_plan(self, counts):
        """``rp_model_set_backward_stage_plan``: layers per backward stage (empty: the
        forward stages)."""
        self._write_plan(lib().rp_model_set_backward_stage_plan, counts)

    def _write_plan(self, setter, counts):
        counts = [int(c) for c in counts]
        array = (c_int32 * max(1, len(counts)))(*counts)
        setter(self.handle, array if counts else None, len(counts))

    def resolve_run_config(self, call=None):
        """The :class:`RunConfig` a call with `call` (a RunConfig or None) would use."""
        return RunConfig(lib().rp_model_resolve_run_config, self.handle,
                         call.handle if call is not None else None)

    def param_find(self, name):
        return query(lib().rp_param_find, self.handle.value, name.encode(), ctype=c_size_t)

    def param_hf_name(self, index):
        """Hugging Face name of parameter `index`; RoundPipeError STATE for other models."""
        return query(lib().rp_param_hf_name, self.handle.value, index, ctype=c_char_p).decode()

    # -- calls ------------------------------------------------------------------------------

    def forward(self, inputs, config):
        """``rp_forward`` on BorrowedInputs; returns the outputs' :class:`TensorList`."""
        return TensorList(lib().rp_forward, self.handle, inputs.array, inputs.count,
                          config.handle)

    def forward_train(self, inputs, config):
        """``rp_forward_train``: as forward, in training mode, keeping what ``backward`` needs."""
        return TensorList(lib().rp_forward_train, self.handle, inputs.array, inputs.count,
                          config.handle)

    def backward(self, grads):
        """``rp_backward`` on BorrowedInputs of the output gradients (NULL entries allowed)."""
        lib().rp_backward(self.handle, grads.array, grads.count)

    def backward_input_grads(self, grads):
        """``rp_backward_input_grads``: as backward, returning the gradient of every input of
        the training forward (torch tensors in host memory; None where the engine gives
        none)."""
        with TensorList(lib().rp_backward_input_grads, self.handle, grads.array,
                        grads.count) as lst:
            return [from_owned(p) if p else None for p in lst.pointers()]

    def forward_backward(self, inputs, label, loss, config, want_outputs):
        """``rp_forward_backward``; `label` a DLManagedTensor* or None. Returns (loss sum,
        TensorList of the outputs or None)."""
        out_loss = c_double()
        out_list = _capi.rp_tensor_list_p()
        lib().rp_forward_backward(byref(out_loss), byref(out_list) if want_outputs else None,
                                  self.handle, inputs.array, inputs.count, label, loss.handle,
                                  config.handle)
        return out_loss.value, (TensorList.adopt(out_list) if want_outputs else None)

    def step(self, optimizer, is_async):
        lib().rp_step(self.handle, optimizer.handle, int(bool(is_async)))

    def set_step_in_call(self, optimizer):
        """``rp_model_set_step_in_call``: `optimizer` a built-in optimizer's settings (its
        ``handle``; the engine copies them) or None (explicit steps again)."""
        lib().rp_model_set_step_in_call(self.handle,
                                        optimizer.handle if optimizer is not None else None)

    def step_in_call(self):
        """``rp_model_step_in_call``: whether training calls step inside."""
        return bool(query(lib().rp_model_step_in_call, self.handle))

    def step_callback(self, key, is_async):
        """Step with the StepCall registered under `key`."""
        lib().rp_step_callback(self.handle, STEP_TRAMPOLINE, key, int(bool(is_async)))

    def call(self, name, *args):
        """``rp_<name>(model, *args)`` for the calls that take only the model and plain values:
        synchronize, zero_grad, model_save, model_load, model_save_hf, model_load_hf,
        model_save_lora, model_load_lora (the saves and loads report progress: tqdm bars by
        default)."""
        with progress_scope():
            getattr(lib(), "rp_" + name)(self.handle, *args)
