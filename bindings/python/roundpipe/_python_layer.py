"""Any nn.Module as a caller-defined engine layer (rp_layer_def, include/roundpipe.h).

The engine owns the layer's parameters and buffers (declared here from the module: trainable
where ``requires_grad``, frozen otherwise; values copied at declaration) and lends them to the
callbacks for each call, on the device, with the device's stream, the phase and a seed. The
forward callback runs ``torch.func.functional_call(module, lent tensors, inputs)``:

- RP_PHASE_FORWARD: no gradient; buffers are the lent ones, so BatchNorm's running statistics
  land in the engine's buffers.
- RP_PHASE_RECOMPUTE: gradient on; inputs and trainable parameters are leaves; buffers are
  clones (their update already happened in the forward). The context keeps the leaves and
  outputs for the backward callback, which runs torch.autograd.grad.
- RP_PHASE_TAIL: like RECOMPUTE, with the lent buffers (they are updated here).

Lent memory is valid only during one callback, but autograd keeps what the forward saved until
the backward. A saved-tensor hook therefore redirects every saved view of lent memory: views of
inputs to a copy made at the time (inputs are not lent again), views of parameters and buffers
to the same view of what the backward callback is lent (no copy of weights).

The random generator is seeded from the call's seed, so dropout masks of a forward and its
recompute match. Exceptions are kept, with the layer's name, and the callback returns nonzero:
the engine fails the call with RP_ERR_CALLBACK and the binding raises the kept error.
"""

import contextlib
import threading
from ctypes import POINTER, byref, c_int32, c_size_t, c_uint64, c_void_p

import torch
from torch.func import functional_call

from . import _capi
from ._callbacks import _CallbackScope, _Registry
from ._capi import kDLCUDA, lib
from ._dlpack import borrow, to_owned
from ._pytree import flatten
from .errors import RoundPipeError, Status
from .recompute import _Run, _running

RP_PHASE_FORWARD, RP_PHASE_RECOMPUTE, RP_PHASE_TAIL = (_capi.RP_PHASE_FORWARD,
                                                        _capi.RP_PHASE_RECOMPUTE,
                                                        _capi.RP_PHASE_TAIL)
_PHASE_NAMES = {RP_PHASE_FORWARD: "forward", RP_PHASE_RECOMPUTE: "recompute",
                RP_PHASE_TAIL: "tail forward"}

#: Python layers of live models, keyed by the user_data given to rp_layer_def_create.
layers = _Registry()
#: Contexts of recomputed / tail forwards, keyed by the value stored in *inout_context.
_contexts = _Registry()
# CPU worker devices share one CPU random generator: a layer seeds and uses it under this lock.
_CPU_RNG_LOCK = threading.Lock()


class LayerCallbackError(RoundPipeError):
    """A Python layer (or a Python loss_fn) failed inside a model call. The message names the
    layer and the original exception, which is also ``__cause__``."""

    def __init__(self, where, exc):
        notes = "".join("; " + note for note in getattr(exc, "__notes__", ()))
        super().__init__(Status.CALLBACK, "%s failed: %s: %s%s" % (where, type(exc).__name__,
                                                                   exc, notes))
        self.__cause__ = exc


class CallState:
    """What one model call keeps on the Python side: the input structure, each layer's output
    structure per microbatch, data saved for recompute, and the first failure."""

    def __init__(self, input_spec=None, training=True):
        self.input_spec = input_spec
        self.training = training
        self.specs = {}  # (microbatch, layer index) -> Spec of that layer's outputs
        self.recompute = {}  # (microbatch, layer index) -> tuple saved for recompute
        self.outputs = {}  # (microbatch, layer index) -> [(shape, dtype)] of the forward
        self.exc = None

    def fail(self, where, exc):
        if self.exc is None:
            self.exc = exc if isinstance(exc, LayerCallbackError) else \
                LayerCallbackError(where, exc)


class LayerRuntime:
    """The Python layers of one model and the CallState of its call in flight (one at a time:
    calls on a model come from the thread driving it)."""

    def __init__(self):
        self.state = None


class LayerCall:
    """The scalar facts and lent tensors of one callback invocation (rp_layer_call)."""

    def __init__(self, call, with_tensors=True):
        phase, dev_type, dev_id, seed, mb, training = (c_int32(), c_int32(), c_int32(),
                                                        c_uint64(), c_int32(), c_int32())
        stream = c_void_p()
        L = lib()
        L.rp_layer_call_info(byref(phase), byref(dev_type), byref(dev_id), byref(stream),
                             byref(seed), byref(mb), byref(training), call)
        self.phase, self.seed, self.microbatch = phase.value, seed.value, mb.value
        self.training = bool(training.value)
        self.cuda = dev_type.value == kDLCUDA
        self.device = torch.device("cuda", dev_id.value) if self.cuda else torch.device("cpu")
        self.stream = stream.value
        self.params, self.buffers = [], []
        if with_tensors:
            p_arr, b_arr = POINTER(c_void_p)(), POINTER(c_void_p)()
            n_p, n_b = c_size_t(), c_size_t()
            L.rp_layer_call_tensors(byref(p_arr), byref(n_p), byref(b_arr), byref(n_b), call)
            self.params = [borrow(p_arr[i]) for i in range(n_p.value)]
            self.buffers = [borrow(b_arr[i]) for i in range(n_b.value)]

    @contextlib.contextmanager
    def on_device(self, seeded=False):
        """Run torch work on the lent device and stream (every kernel and copy of a callback
        goes there: the engine orders its transfers against that stream only, and torch's
        legacy default stream would serialise against the whole device); `seeded`: with the
        random generator of that device seeded from the call's seed (see seeded_rng)."""
        if not self.cuda:
            with contextlib.ExitStack() as stack:
                if seeded:
                    stack.enter_context(self.seeded_rng())
                yield
            return
        stream = torch.cuda.ExternalStream(self.stream, device=self.device) if self.stream \
            else torch.cuda.default_stream(self.device)
        with torch.cuda.device(self.device.index), torch.cuda.stream(stream), \
                contextlib.ExitStack() as stack:
            if seeded:
                stack.enter_context(self.seeded_rng())
            yield

    @contextlib.contextmanager
    def seeded_rng(self):
        """The random generator of the call's device seeded from the call's seed, restored
        afterwards (host-side generator state only: no device work, no synchronisation)."""
        if not self.cuda:
            with _CPU_RNG_LOCK, torch.random.fork_rng(devices=[]):
                torch.random.default_generator.manual_seed(self.seed)
                yield
            return
        index = self.device.index
        with torch.random.fork_rng(devices=[index]):
            torch.cuda.manual_seed(self.seed)  # the current device only
            yield


def _storage(t):
    return t.untyped_storage().data_ptr()


def owned_copy_if_lent(t, lent):
    """`t` itself, or a copy when it is a view of lent memory (`lent`: storage pointers), so
    that what we hand to the engine never points into memory it only lent us."""
    t = t.detach()
    return t.clone() if _storage(t) in lent else t


class _Context:
    """What a recompute or tail forward keeps until its backward."""

    __slots__ = ("input_leaves", "param_leaves", "outputs", "lent", "backward_lend")

    def __init__(self):
        self.input_leaves = []  # per input: the leaf tensor, or None (no gradient)
        self.param_leaves = []  # per parameter: the leaf tensor, or None (frozen)
        self.outputs = []  # per output tensor
        self.lent = {}  # storage pointer -> ("input", copy) or ("param"/"buffer", index, base)
        self.backward_lend = None  # (params, buffers) lent to the backward callback

    def pack(self, t):
        entry = self.lent.get(_storage(t))
        if entry is None:
            return t
        if entry[0] == "input":  # inputs are not lent again: copy the lent input once
            _, base, copy = entry
            if copy is None:
                copy = torch.empty_strided(base.size(), base.stride(), dtype=base.dtype,
                                           device=base.device).copy_(base)
                self.lent[_storage(t)] = ("input", base, copy)
            return copy.as_strided(t.size(), t.stride(),
                                   copy.storage_offset() + t.storage_offset()
                                   - base.storage_offset())
        kind, index, base = entry  # resolved against the backward's lend (unpack)
        return (kind, index, t.size(), t.stride(), t.storage_offset() - base.storage_offset())

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        kind, index, size, stride, offset = packed
        if self.backward_lend is None:
            raise RuntimeError("a saved %s is needed outside the backward callback" % kind)
        base = self.backward_lend[0 if kind == "param" else 1][index]
        return base.as_strided(size, stride, base.storage_offset() + offset)


class PythonLayer:
    """One nn.Module as layer `index` of a model; `name` is its qualified name in the user's
    module. `after_builtin`: the previous layer is built-in (its output is one tensor);
    `before_builtin`: the next is, and reads only tensor 0."""

    def __init__(self, module, index, name, runtime, first, after_builtin, before_builtin):
        self.module = module
        self.index = index
        self.name = name
        self.runtime = runtime  # .state: the CallState of the call in flight
        self.first = first
        self.after_builtin = after_builtin
        self.before_builtin = before_builtin
        named = list(module.named_parameters())
        self.param_names = [n for n, _ in named]
        self.trainable = [p.requires_grad and p.is_floating_point() for _, p in named]
        self.buffer_names = [n for n, _ in module.named_buffers()]
        self.key = None

    @property
    def type_name(self):
        return "python:" + type(self.module).__name__

    @property
    def where(self):
        return "layer %d (%s%s)" % (self.index, self.type_name,
                                    " '%s'" % self.name if self.name else "")

    def declare(self, shared=None):
        """A new rp_layer_def (owned by the caller) with this module's parameters and
        buffers; registers the layer for its callbacks. `shared` maps id(parameter) to the
        engine name of an earlier Python layer's declaration of it: such a parameter (tied
        weights) is declared tied, so the engine keeps one weight whose gradient sums both
        uses; this layer's own parameters are added to it."""
        from ._internals import LayerDef  # the handle owner
        self.key = layers.add(self)
        layer_def = LayerDef(self.type_name, FORWARD_TRAMPOLINE, BACKWARD_TRAMPOLINE,
                             RELEASE_TRAMPOLINE, self.key)
        try:
            for (name, p), trainable in zip(self.module.named_parameters(), self.trainable):
                if shared is not None and id(p) in shared:
                    layer_def.add_tied_param(name, shared[id(p)])
                    continue
                layer_def.add_param(name, p.detach(), trainable)
                if shared is not None:
                    shared[id(p)] = "%d.%s" % (self.index, name)
            for name, b in self.module.named_buffers():
                layer_def.add_buffer(name, b.detach())
        except BaseException:
            layer_def.close()
            raise
        return layer_def

    def unregister(self):
        if self.key is not None:
            layers.pop(self.key)
            self.key = None

    # -- forward ------------------------------------------------------------------------------

    def _arguments(self, state, microbatch, tensors):
        """(args, kwargs) of the module from the flat input tensors."""
        if self.first:
            args, kwargs = state.input_spec.unflatten(tensors)
            return tuple(args), dict(kwargs)
        if self.after_builtin:
            return (tensors[0],), {}
        value = state.specs[(microbatch, self.index - 1)].unflatten(tensors)
        # A tuple is the next layer's positional arguments (as upstream's Sequential passes
        # them); anything else is its one argument.
        return (value if type(value) is tuple else (value,)), {}

    def _note_tuple_arguments(self, exc, args):
        """On a TypeError from a module that got a tuple spread over its positional arguments
        (the likely cause: nn.Sequential would have passed the tuple as one argument), a note
        saying so, which LayerCallbackError's message carries."""
        if self.first or self.after_builtin or len(args) < 2 or not hasattr(exc, "add_note"):
            return
        exc.add_note("layer %d returned a tuple of %d, which RoundPipe passes to layer %d as %d "
                     "positional arguments, as upstream's Sequential does, where nn.Sequential "
                     "passes it as one" % (self.index - 1, len(args), self.index, len(args)))

    def forward(self, out_outputs, inout_context, call_ptr, inputs, n_inputs):
        lend = LayerCall(call_ptr)
        with lend.on_device():  # clones, copies and exports too, not only the module's work
            self._forward(lend, out_outputs, inout_context, inputs, n_inputs)

    def _forward(self, lend, out_outputs, inout_context, inputs, n_inputs):
        state = self.runtime.state
        phase, mb = lend.phase, lend.microbatch
        grad = phase != RP_PHASE_FORWARD
        lent_inputs = [borrow(inputs[i]) for i in range(n_inputs)]
        ctx = _Context() if grad else None
        lent = set()
        for i, t in enumerate(lent_inputs):
            lent.add(_storage(t))
            if grad:
                ctx.lent[_storage(t)] = ("input", t, None)
        for kind, group in (("param", lend.params), ("buffer", lend.buffers)):
            for i, t in enumerate(group):
                lent.add(_storage(t))
                if grad:
                    ctx.lent[_storage(t)] = (kind, i, t)
        if len(lend.params) != len(self.param_names) or \
                len(lend.buffers) != len(self.buffer_names):
            raise RuntimeError("the engine lent %d parameters and %d buffers, the module has "
                               "%d and %d" % (len(lend.params), len(lend.buffers),
                                              len(self.param_names), len(self.buffer_names)))
        if grad:
            ctx.input_leaves = [t.detach().requires_grad_() if t.is_floating_point() else None
                                for t in lent_inputs]
            ctx.param_leaves = [p.detach().requires_grad_() if trainable else None
                                for p, trainable in zip(lend.params, self.trainable)]
            tensors = [leaf if leaf is not None else t
                       for leaf, t in zip(ctx.input_leaves, lent_inputs)]
            params = [leaf if leaf is not None else p
                      for leaf, p in zip(ctx.param_leaves, lend.params)]
        else:
            tensors, params = lent_inputs, lend.params
        # The recompute must not change buffers: it works on copies.
        buffers = [b.clone() for b in lend.buffers] if phase == RP_PHASE_RECOMPUTE \
            else lend.buffers
        weights = dict(zip(self.param_names, params))
        weights.update(zip(self.buffer_names, buffers))
        args, kwargs = self._arguments(state, mb, tensors)
        run = _Run(state.recompute, (mb, self.index),
                   recording=phase == RP_PHASE_FORWARD and lend.training,
                   recomputing=phase == RP_PHASE_RECOMPUTE)
        with lend.seeded_rng(), _running(run), torch.set_grad_enabled(grad), \
                contextlib.ExitStack() as stack:
            if grad:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(ctx.pack,
                                                                             ctx.unpack))
            try:
                result = functional_call(self.module, weights, args, kwargs, strict=False)
            except TypeError as exc:
                self._note_tuple_arguments(exc, args)
                raise
        outputs, spec = flatten(result)
        if not outputs:
            raise TypeError("the module returned no tensor (%r); a layer must output at least "
                            "one tensor" % (type(result).__name__,))
        if self.before_builtin and not spec.is_single_tensor:
            raise TypeError("the next layer is a built-in engine layer, which takes one tensor;"
                            " this module returned %s with %d tensors"
                            % (type(result).__name__, len(outputs)))
        if phase == RP_PHASE_RECOMPUTE:
            _check_recompute(state.outputs.get((mb, self.index)), outputs)
        state.specs[(mb, self.index)] = spec
        if phase == RP_PHASE_FORWARD and lend.training:
            state.outputs[(mb, self.index)] = [(t.shape, t.dtype) for t in outputs]
        for t in outputs:
            _push(out_outputs, owned_copy_if_lent(t, lent))
        if grad:
            ctx.outputs = outputs
            inout_context[0] = _contexts.add(ctx)

    # -- backward -----------------------------------------------------------------------------

    def param_grads(self, ctx, grads):
        """Per parameter: its gradient or None (frozen). A hook for tests of bad gradients."""
        return grads

    def backward(self, out_input_grads, out_param_grads, context, call_ptr, output_grads,
                 n_outputs):
        ctx = _contexts.get(context)
        if ctx is None:
            raise RuntimeError("backward without a context")
        lend = LayerCall(call_ptr)
        with lend.on_device():
            self._backward(lend, ctx, out_input_grads, out_param_grads, output_grads,
                           n_outputs)

    def _backward(self, lend, ctx, out_input_grads, out_param_grads, output_grads, n_outputs):
        lent_grads = [borrow(output_grads[i]) for i in range(n_outputs)]
        if n_outputs != len(ctx.outputs):
            raise RuntimeError("the engine gave %d output gradients for %d outputs"
                               % (n_outputs, len(ctx.outputs)))
        lent = {_storage(t) for t in lent_grads if t is not None}
        lent.update(_storage(t) for t in lend.params + lend.buffers)
        outs, gouts = [], []
        for out, g in zip(ctx.outputs, lent_grads):
            if g is not None and out.requires_grad:
                outs.append(out)
                gouts.append(g if g.dtype == out.dtype else g.to(out.dtype))
        leaves = [t for t in ctx.input_leaves + ctx.param_leaves if t is not None]
        ctx.backward_lend = (lend.params, lend.buffers)
        try:
            found = torch.autograd.grad(outs, leaves, gouts, allow_unused=True) \
                if outs and leaves else [None] * len(leaves)
        finally:
            ctx.backward_lend = None
        found = iter(found)
        in_grads = [next(found) if t is not None else None for t in ctx.input_leaves]
        p_grads = [next(found) if t is not None else None for t in ctx.param_leaves]
        p_grads = self.param_grads(ctx, p_grads)
        for g in in_grads:
            _push(out_input_grads, None if g is None else owned_copy_if_lent(g, lent))
        for g in p_grads:
            _push(out_param_grads, None if g is None else owned_copy_if_lent(g, lent))


def _check_recompute(forward, outputs):
    """The recompute must return what the forward returned (the engine routes the backward
    by the forward's outputs): same number of tensors, shapes and dtypes."""
    if forward is None:
        return
    got = [(t.shape, t.dtype) for t in outputs]
    if got != forward:
        raise ValueError("the recompute returned %s, the forward returned %s (a layer must "
                         "compute the same outputs in both; save_for_recompute keeps data "
                         "that must not change)" % (_describe(got), _describe(forward)))


def _describe(outputs):
    return "%d tensors [%s]" % (len(outputs), ", ".join(
        "%s %s" % (tuple(shape), str(dtype).replace("torch.", "")) for shape, dtype in outputs))


def _push(tensor_list, tensor):
    """Append to an engine-created rp_tensor_list (it takes ownership, also on failure)."""
    lib().rp_tensor_list_push(tensor_list, to_owned(tensor) if tensor is not None else None)


# ------------------------------------------------------------------------------------------------
# Trampolines: one per callback kind for the whole process; user_data is the layer's key.
# ------------------------------------------------------------------------------------------------


def _guarded(user_data, phase_of, body):
    """Run `body(layer)`; any exception is kept (naming the layer) and reported as 1."""
    with _CallbackScope(library_thread=True):
        layer = layers.get(user_data)
        if layer is None:
            return 1
        try:
            body(layer)
            return 0
        except BaseException as exc:  # noqa: B902 - nothing may escape into C
            state = layer.runtime.state
            where = "%s, %s" % (layer.where, phase_of())
            if state is not None:
                state.fail(where, exc)
            return 1


def _forward_entry(out_outputs, inout_context, call, inputs, n_inputs, user_data):
    def phase():
        try:
            return _PHASE_NAMES.get(LayerCall(call, with_tensors=False).phase, "forward")
        except Exception:
            return "forward"
    return _guarded(user_data, phase, lambda layer: layer.forward(
        out_outputs, inout_context, call, inputs, n_inputs))


def _backward_entry(out_input_grads, out_param_grads, context, call, output_grads, n_outputs,
                    user_data):
    return _guarded(user_data, lambda: "backward", lambda layer: layer.backward(
        out_input_grads, out_param_grads, context, call, output_grads, n_outputs))


def _release_entry(context, user_data):
    with _CallbackScope(library_thread=True):
        _contexts.pop(context)


FORWARD_TRAMPOLINE = _capi.rp_layer_forward_fn(_forward_entry)
BACKWARD_TRAMPOLINE = _capi.rp_layer_backward_fn(_backward_entry)
RELEASE_TRAMPOLINE = _capi.rp_layer_release_fn(_release_entry)

__all__ = ["PythonLayer", "CallState", "LayerRuntime", "LayerCall", "LayerCallbackError", "layers",
           "owned_copy_if_lent"]
