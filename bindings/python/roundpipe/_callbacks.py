"""Python callables that the library's threads call back: loss functions, step functions,
custom split functions, and the log and progress sinks (the logger "roundpipe" and tqdm bars by
default, installed when the library loads).

One CFUNCTYPE trampoline per kind lives for the whole process, so no callback object can be
collected while C may still call it. The C ``user_data`` is a key into a registry of the calls
in flight; each entry holds the user's callable and a slot for the exception it raised. A
trampoline never lets an exception escape into C (ctypes would print it and return 0, which C
would read as success): it stores the exception and returns 1; the method that made the C call
re-raises it once the call has returned.
"""

import atexit
import contextlib
import itertools
import logging
import os
import threading

import torch

from . import _capi
from ._dlpack import copy_borrowed, to_owned


class _Registry:
    def __init__(self):
        self._lock = threading.Lock()
        self._items = {}
        self._keys = itertools.count(1)  # 0 would read as NULL

    def add(self, obj):
        with self._lock:
            key = next(self._keys)
            self._items[key] = obj
            return key

    def get(self, key):
        with self._lock:
            return self._items.get(key)

    def pop(self, key):
        with self._lock:
            return self._items.pop(key, None)

    def __len__(self):
        with self._lock:
            return len(self._items)


#: Calls in flight, keyed by the user_data given to C.
registry = _Registry()

# Library threads must never drop the last reference to a RoundPipe: its destructor would wait
# for the very thread it runs on. Finished step calls (whose step_fn may close over the model)
# are parked here, and models collected on a library thread leave their handle here; the thread
# driving a model empties both at its next call (release_parked()).
_parked_calls = []
_parked_handles = []
_in_callback = threading.local()


def in_library_thread():
    """True on a RoundPipe thread (one that ran a loss or step callback: such a thread never
    drives a model) and inside any callback."""
    return getattr(_in_callback, "library", False) or getattr(_in_callback, "depth", 0) > 0


def park_handle(handle, destroy):
    _parked_handles.append((handle, destroy))


def release_parked():
    """Drop parked calls and destroy parked handles; only on a thread that drives models."""
    if in_library_thread():
        return
    while _parked_calls:
        _parked_calls.pop()
    while _parked_handles:
        handle, destroy = _parked_handles.pop()
        destroy(handle)


class _CallbackScope:
    def __init__(self, library_thread):
        self.library_thread = library_thread

    def __enter__(self):
        if self.library_thread:  # for good: a collection may run here between callbacks too
            _in_callback.library = True
        _in_callback.depth = getattr(_in_callback, "depth", 0) + 1

    def __exit__(self, *exc):
        _in_callback.depth -= 1


# ------------------------------------------------------------------------------------------------
# Loss
# ------------------------------------------------------------------------------------------------


def loss_terms(result):
    """The tensors a loss_fn returned (one, or a sequence whose terms add up), each checked to
    hold one element: a loss that is not reduced would otherwise fail deep in autograd
    ("grad can be implicitly created only for scalar outputs")."""
    losses = [result] if isinstance(result, torch.Tensor) else \
        list(result) if isinstance(result, (tuple, list)) else [result]
    for loss in losses:
        if not isinstance(loss, torch.Tensor):
            raise TypeError("loss_fn must return a tensor or a sequence of tensors, got %s"
                            % type(loss).__name__)
        if loss.numel() != 1:
            raise RuntimeError("loss_fn must return a scalar loss (one element), got a tensor of "
                               "shape %s: reduce it, e.g. with .mean() or .sum()"
                               % list(loss.shape))
    return losses


class LossCall:
    """One forward_backward with a Python loss_fn. `labels` is the per-microbatch list split by
    the binding, or None when the engine passes its own label pieces (or there is none)."""

    def __init__(self, fn, labels):
        self.fn = fn
        self.labels = labels
        self.exc = None

    def compute(self, outputs, label):
        """(loss value, gradient of the loss with respect to `outputs`)."""
        device = _cuda_device_of(label)
        if device is not None:  # labels on a GPU: compute the loss there, as upstream does
            outputs = outputs.to(device)
        with torch.enable_grad():
            outputs.requires_grad_(True)
            losses = loss_terms(self.fn(outputs, label))
            value = sum(float(loss.detach().double().sum()) for loss in losses)
            with_grad = [loss for loss in losses if loss.requires_grad]
            if with_grad:
                torch.autograd.backward(with_grad)
        grad = outputs.grad
        if grad is None:
            grad = torch.zeros_like(outputs)
        if grad.is_cuda:  # hand it back where the outputs came from (a synchronous copy)
            grad = grad.to("cpu")
        return value, grad.detach()


def _cuda_device_of(obj):
    """The device of the first CUDA tensor in a nest of tuples, lists and dicts, else None."""
    if isinstance(obj, torch.Tensor):
        return obj.device if obj.is_cuda else None
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        for item in obj:
            device = _cuda_device_of(item)
            if device is not None:
                return device
    return None


def _loss_entry(out_loss, out_grad, outputs, labels, microbatch, user_data):
    with _CallbackScope(library_thread=True):
        return _loss_body(out_loss, out_grad, outputs, labels, microbatch, user_data)


def _loss_body(out_loss, out_grad, outputs, labels, microbatch, user_data):
    call = registry.get(user_data)
    if call is None:
        return 1
    try:
        out = copy_borrowed(outputs)
        label = call.labels[microbatch] if call.labels is not None else copy_borrowed(labels)
        value, grad = call.compute(out, label)
        out_loss[0] = value
        out_grad[0] = to_owned(grad)  # last: only a complete result hands memory over
        return 0
    except BaseException as exc:  # noqa: B902 - nothing may escape into C
        if call.exc is None:
            call.exc = exc
        return 1


LOSS_TRAMPOLINE = _capi.rp_loss_fn(_loss_entry)


# ------------------------------------------------------------------------------------------------
# Step
# ------------------------------------------------------------------------------------------------


class StepCall:
    """One step(step_fn): the function, its arguments and the model's parameter state."""

    def __init__(self, params, fn, args, kwargs):
        self.params = params
        self.fn = fn
        self.args = args
        self.kwargs = kwargs


def _step_entry(model, user_data):
    with _CallbackScope(library_thread=True):
        call = registry.pop(user_data)
        if call is None:
            return 1
        try:
            return _step_body(model, call)
        finally:
            _parked_calls.append(call)  # the last reference leaves with the driving thread
            del call


def _step_body(model, call):
    params = call.params
    try:
        params.attach_grads(model)
        try:
            call.fn(*call.args, **call.kwargs)
        finally:
            params.detach_grads()
        return 0
    except BaseException as exc:  # noqa: B902
        params.record_step_exception(exc)
        return 1


STEP_TRAMPOLINE = _capi.rp_step_fn(_step_entry)


# ------------------------------------------------------------------------------------------------
# Split
# ------------------------------------------------------------------------------------------------


class SplitCall:
    """One call with a custom split_input function: it is called with the call's own Python
    arguments (the DLPack inputs C passes are those same tensors)."""

    def __init__(self, fn, args, kwargs, flatten):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.flatten = flatten  # (args, kwargs) -> list of tensors, same layout as the inputs
        self.exc = None


def _split_entry(out_pieces, inputs, n_inputs, num_microbatch, user_data):
    with _CallbackScope(library_thread=False):  # runs on the caller's thread
        return _split_body(out_pieces, n_inputs, num_microbatch, user_data)


def _split_body(out_pieces, n_inputs, num_microbatch, user_data):
    call = registry.get(user_data)
    if call is None:
        return 1
    try:
        result = call.fn(call.args, call.kwargs, num_microbatch)
        try:
            args_list, kwargs_list = result
        except (TypeError, ValueError):
            raise TypeError("split_input function must return (args_list, kwargs_list)") \
                from None
        args_list, kwargs_list = list(args_list), list(kwargs_list)
        if len(args_list) != num_microbatch or len(kwargs_list) != num_microbatch:
            raise ValueError("split_input function returned %d args and %d kwargs entries for "
                             "%d microbatches" % (len(args_list), len(kwargs_list),
                                                 num_microbatch))
        pieces = []
        for m in range(num_microbatch):
            flat = call.flatten(args_list[m], kwargs_list[m])
            if len(flat) != n_inputs:
                raise ValueError("split_input function: microbatch %d has %d inputs, the call "
                                 "has %d" % (m, len(flat), n_inputs))
            pieces.extend(flat)
        for slot, piece in enumerate(pieces):
            out_pieces[slot] = to_owned(piece)
        return 0
    except BaseException as exc:  # noqa: B902
        if call.exc is None:
            call.exc = exc
        return 1


SPLIT_TRAMPOLINE = _capi.rp_split_fn(_split_entry)


# ------------------------------------------------------------------------------------------------
# Log: the library's messages go to the logger "roundpipe" unless set_log_callback says otherwise
# ------------------------------------------------------------------------------------------------

#: The logger the library's messages go to by default.
LOGGER = logging.getLogger("roundpipe")

_PY_LEVELS = {_capi.RP_LOG_DEBUG: logging.DEBUG, _capi.RP_LOG_INFO: logging.INFO,
              _capi.RP_LOG_WARN: logging.WARNING, _capi.RP_LOG_ERROR: logging.ERROR}
# RP_LOG_LEVEL's values (the header's list of environment variables); the library reads it too.
_ENV_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
               "warning": logging.WARNING, "error": logging.ERROR}


def _to_logging(level, message):
    py_level = _PY_LEVELS.get(level, logging.ERROR)
    if LOGGER.isEnabledFor(py_level):
        LOGGER.log(py_level, message)


_log_state = {"fn": None}


def _log_entry(level, message, user_data):
    fn = _log_state["fn"]
    if fn is None:
        return
    try:
        fn(int(level), message.decode("utf-8", "replace") if message else "")
    except BaseException:  # noqa: B902 - a logger must not break the library
        pass


# One trampoline for the whole process: the library may call it from any of its threads.
LOG_TRAMPOLINE = _capi.rp_log_fn(_log_entry)


def set_log_callback(fn, min_level=_capi.RP_LOG_WARN):
    """Route the library's log messages at or above `min_level` (0 debug, 1 info, 2 warn,
    3 error) to ``fn(level, message)``; None restores the default: every message to the logger
    ``logging.getLogger("roundpipe")`` at the matching level (DEBUG, INFO, WARNING, ERROR),
    which filters them by its own level. The environment variable RP_LOG_LEVEL (debug, info,
    warn, error), when set, overrides `min_level` and is also the level of that logger.

    `fn` runs on whichever RoundPipe thread logs, one call at a time; it must not call back
    into RoundPipe. Exceptions it raises are ignored.
    """
    L = _capi.lib()
    if fn is None:
        fn, min_level = _to_logging, _capi.RP_LOG_DEBUG
    elif not callable(fn):
        raise TypeError("fn must be callable or None")
    previous, _log_state["fn"] = _log_state["fn"], fn
    try:
        L.rp_set_log_callback(LOG_TRAMPOLINE, int(min_level), None)
    except BaseException:
        _log_state["fn"] = previous
        raise


# ------------------------------------------------------------------------------------------------
# Progress: loading and saving weights draw tqdm bars unless set_progress_callback says otherwise
# ------------------------------------------------------------------------------------------------

_progress_state = {"fn": None}  # the user's callable; None: tqdm bars
_progress_local = threading.local()  # .bars: what -> open tqdm bar, of this thread's calls
_VERBS = {"load": "Loading", "save": "Saving"}


def _new_bar(what, total):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bars without it
        return None
    verb, _, path = what.partition(" ")
    name = os.path.basename(path.rstrip("/")) or path
    return tqdm(total=total, desc="%s %s" % (_VERBS.get(verb, verb), name), unit="B",
                unit_scale=True, unit_divisor=1024, dynamic_ncols=True)


def _draw_bar(what, done, total):
    bars = getattr(_progress_local, "bars", None)
    if bars is None:
        bars = _progress_local.bars = {}
    bar = bars.get(what)
    if bar is None:
        bar = _new_bar(what, total)
        if bar is None:
            return
        bars[what] = bar
    bar.update(done - bar.n)
    if done >= total:
        bars.pop(what).close()


def _progress_entry(what, done, total, user_data):
    # The library calls this on the thread that made the call being reported.
    try:
        text = what.decode("utf-8", "replace") if what else ""
        fn = _progress_state["fn"]
        (fn or _draw_bar)(text, int(done), int(total))
    except BaseException:  # noqa: B902 - a progress display must not break a load or save
        pass


PROGRESS_TRAMPOLINE = _capi.rp_progress_fn(_progress_entry)


@contextlib.contextmanager
def progress_scope():
    """Around a call that may report progress: closes the bars a failed operation left open."""
    try:
        yield
    finally:
        bars = getattr(_progress_local, "bars", None)
        while bars:
            bars.popitem()[1].close()


def set_progress_callback(fn):
    """Report the progress of loading and saving weights (building a model from a Hugging Face
    directory, load, save, load_pretrained, save_pretrained) to ``fn(what, done, total)``
    instead of the default tqdm progress bars (drawn when tqdm is installed; TQDM_DISABLE=1
    hides them). `what` is "load <path>" or "save <path>", `done` and `total` count bytes, and
    an operation that succeeds ends with one call where done == total. `fn` runs on the thread
    that made the call; exceptions it raises are ignored. None restores the bars."""
    if fn is not None and not callable(fn):
        raise TypeError("fn must be callable or None")
    _progress_state["fn"] = fn


# ------------------------------------------------------------------------------------------------
# Installed when the library loads, removed when the interpreter exits
# ------------------------------------------------------------------------------------------------


def _install_sinks():
    env_level = _ENV_LEVELS.get(os.environ.get("RP_LOG_LEVEL", "").strip().lower())
    if env_level is not None:
        LOGGER.setLevel(env_level)
    set_log_callback(None)
    _capi.lib().rp_set_progress_callback(PROGRESS_TRAMPOLINE, None)


_capi.on_load(_install_sinks)


@atexit.register
def _restore_default_sinks():
    # No library thread may call into an interpreter that is shutting down.
    if _capi._LIB is not None:
        try:
            _capi._LIB.rp_set_log_callback(_capi.rp_log_fn(), _capi.RP_LOG_WARN, None)
            _capi._LIB.rp_set_progress_callback(_capi.rp_progress_fn(), None)
        except Exception:
            pass
        _log_state["fn"] = None
