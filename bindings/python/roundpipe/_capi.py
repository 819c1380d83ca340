"""The C API of libroundpipe, declared once for ctypes.

Every function of ``include/roundpipe.h`` is declared here with its ``argtypes`` and
``restype``; functions returning ``rp_status`` get an ``errcheck`` that raises
:class:`~roundpipe.errors.RoundPipeError` with ``rp_last_error_message()``. The C prototype
stands beside each declaration. Nothing else in the package calls ``ctypes.CDLL``.

The library is loaded on first use (:func:`lib`), from, in order:
  1. the file named by the environment variable ``ROUNDPIPE_LIBRARY``;
  2. ``libroundpipe.so`` next to this package (a wheel may bundle it there);
  3. the build trees of a source checkout (``<repo>/build/``, ``<repo>/build*/``);
  4. the system's library path (``ctypes.util.find_library("roundpipe")``).
The error lists every path tried and why each failed.

ctypes releases the GIL during every call into the library, which is what lets the library's
threads run Python callbacks (loss functions, step functions) while the caller waits.
"""

import ctypes
import ctypes.util
import glob
import os
import re
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_double, c_int, c_int32,
                    c_int64, c_size_t, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p)

# libroundpipe links the libtorch of the pip wheel; importing torch first makes the process load
# those libraries once, from the wheel, for both torch and RoundPipe.
import torch  # noqa: F401  (imported for its side effect on the dynamic loader)

from .errors import LibraryNotFoundError, RoundPipeError, Status  # noqa: F401 (re-export)

#: The ABI version this binding was written for (RP_ABI_VERSION in roundpipe.h).
ABI_VERSION = 1

# ------------------------------------------------------------------------------------------------
# DLPack 1.x structures, as declared in roundpipe.h.
# ------------------------------------------------------------------------------------------------

kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3


class DLDevice(Structure):
    _fields_ = [("device_type", c_int), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class DLManagedTensor(Structure):
    pass


# void (*deleter)(struct DLManagedTensor *self);
DLManagedTensorDeleter = CFUNCTYPE(None, POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", c_void_p),
    ("deleter", DLManagedTensorDeleter),
]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


# ------------------------------------------------------------------------------------------------
# Opaque handles. Distinct c_void_p subclasses, so a model handle cannot be passed for a loss.
# ------------------------------------------------------------------------------------------------


class rp_run_config_p(c_void_p):
    pass


class rp_model_options_p(c_void_p):
    pass


class rp_model_p(c_void_p):
    pass


class rp_tensor_list_p(c_void_p):
    pass


class rp_loss_p(c_void_p):
    pass


class rp_optimizer_p(c_void_p):
    pass


class rp_layer_def_p(c_void_p):
    pass


# ------------------------------------------------------------------------------------------------
# Enumerations (mirrors of the header's enums; ctypes cannot see C macros or enums).
# ------------------------------------------------------------------------------------------------

RP_LOG_DEBUG, RP_LOG_INFO, RP_LOG_WARN, RP_LOG_ERROR = 0, 1, 2, 3
RP_DTYPE_DEFAULT, RP_DTYPE_F32, RP_DTYPE_BF16, RP_DTYPE_F16 = 0, 1, 2, 3
RP_PIN_ALLOC, RP_PIN_REGISTER, RP_PIN_OFF = 0, 1, 2
RP_HOST_MEMORY_STANDARD, RP_HOST_MEMORY_SAVING = 0, 1
RP_DEVICE_AUTO, RP_DEVICE_CPU, RP_DEVICE_CUDA = 0, 1, 2
RP_GRAIN_DEFAULT, RP_GRAIN_STAGE, RP_GRAIN_LAYER = 0, 1, 2
RP_SPLIT_REPLICATE = -1
RP_LOSS_OUTPUT, RP_LOSS_MSE, RP_LOSS_CROSS_ENTROPY, RP_LOSS_CAUSAL_LM = 0, 1, 2, 3
RP_OPTIMIZER_ADAMW, RP_OPTIMIZER_SGD = 0, 1
RP_PHASE_FORWARD, RP_PHASE_RECOMPUTE, RP_PHASE_TAIL = 0, 1, 2
RP_PARAM_TRAINABLE, RP_PARAM_FROZEN, RP_PARAM_BUFFER = 0, 1, 2

# ------------------------------------------------------------------------------------------------
# Callback types. Pointer arguments arrive as Python ints (or None for NULL).
# ------------------------------------------------------------------------------------------------

# typedef void (*rp_log_fn)(int32_t level, const char *message, void *user_data);
rp_log_fn = CFUNCTYPE(None, c_int32, c_char_p, c_void_p)

# typedef void (*rp_progress_fn)(const char *what, int64_t done, int64_t total, void *user_data);
rp_progress_fn = CFUNCTYPE(None, c_char_p, c_int64, c_int64, c_void_p)

# typedef int32_t (*rp_split_fn)(DLManagedTensor **out_pieces,
#     const DLManagedTensor *const *inputs, size_t n_inputs, int32_t num_microbatch,
#     void *user_data);
rp_split_fn = CFUNCTYPE(c_int32, POINTER(c_void_p), POINTER(c_void_p), c_size_t, c_int32,
                        c_void_p)

# typedef int32_t (*rp_loss_fn)(double *out_loss, DLManagedTensor **out_grad,
#     const DLManagedTensor *outputs, const DLManagedTensor *labels, int32_t microbatch,
#     void *user_data);
rp_loss_fn = CFUNCTYPE(c_int32, POINTER(c_double), POINTER(c_void_p), c_void_p, c_void_p,
                       c_int32, c_void_p)

# typedef int32_t (*rp_step_fn)(rp_model *model, void *user_data);
rp_step_fn = CFUNCTYPE(c_int32, c_void_p, c_void_p)

# typedef int32_t (*rp_layer_forward_fn)(rp_tensor_list *out_outputs, void **inout_context,
#     const rp_layer_call *call, const DLManagedTensor *const *inputs, size_t n_inputs,
#     void *user_data);
rp_layer_forward_fn = CFUNCTYPE(c_int32, c_void_p, POINTER(c_void_p), c_void_p,
                                POINTER(c_void_p), c_size_t, c_void_p)

# typedef int32_t (*rp_layer_backward_fn)(rp_tensor_list *out_input_grads,
#     rp_tensor_list *out_param_grads, void *context, const rp_layer_call *call,
#     const DLManagedTensor *const *output_grads, size_t n_outputs, void *user_data);
rp_layer_backward_fn = CFUNCTYPE(c_int32, c_void_p, c_void_p, c_void_p, c_void_p,
                                 POINTER(c_void_p), c_size_t, c_void_p)

# typedef void (*rp_layer_release_fn)(void *context, void *user_data);
rp_layer_release_fn = CFUNCTYPE(None, c_void_p, c_void_p)

# typedef int32_t (*rp_device_loss_fn)(DLManagedTensor **out_loss, rp_tensor_list *out_grads,
#     const rp_layer_call *call, const DLManagedTensor *const *outputs, size_t n_outputs,
#     const DLManagedTensor *labels, void *user_data);
rp_device_loss_fn = CFUNCTYPE(c_int32, POINTER(c_void_p), c_void_p, c_void_p,
                              POINTER(c_void_p), c_size_t, c_void_p, c_void_p)

# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_LIB_NAMES = ("libroundpipe.so", "libroundpipe.so.1")


def candidate_paths():
    """The places searched for the library, in order (environment variable first)."""
    paths = []
    env = os.environ.get("ROUNDPIPE_LIBRARY")
    if env:
        # A relative path is taken from the current directory now, so that library_path()
        # names the same file for child processes started elsewhere.
        paths.append(("ROUNDPIPE_LIBRARY", os.path.abspath(env) if os.sep in env else env))
    for name in _LIB_NAMES:
        paths.append(("next to the package", os.path.join(_PACKAGE_DIR, name)))
    # bindings/python/roundpipe -> repository root, when the package sits in a source checkout
    repo = os.path.normpath(os.path.join(_PACKAGE_DIR, "..", "..", ".."))
    if os.path.exists(os.path.join(repo, "include", "roundpipe.h")):
        trees = [os.path.join(repo, "build")]
        trees += sorted(p for p in glob.glob(os.path.join(repo, "build*"))
                        if os.path.isdir(p) and p not in trees)
        for tree in trees:
            paths.append(("build tree", os.path.join(tree, "libroundpipe.so")))
    found = ctypes.util.find_library("roundpipe")
    if found:
        paths.append(("system library path", found))
    return paths


def _status_check(result, func, args):
    """errcheck of every function returning rp_status."""
    if result != 0:
        message = _LIB.rp_last_error_message()
        message = message.decode("utf-8", "replace") if message else ""
        raise RoundPipeError(result, message or "%s failed" % func.__name__)
    return result


def _declare(cdll):
    """Set argtypes/restype/errcheck of every function of roundpipe.h on `cdll`."""

    def fn(name, restype, argtypes):
        f = getattr(cdll, name)
        f.argtypes = argtypes
        if restype is _STATUS:
            f.restype = c_int
            f.errcheck = _status_check
        else:
            f.restype = restype
        return f

    for declare in (_declare_base, _declare_model, _declare_calls, _declare_params):
        declare(fn)

    # A library from before caller-defined layers still serves every model the engine builds
    # itself; using a Python layer with it raises (missing_layer_api names the library).
    def optional(name, restype, argtypes):
        if hasattr(cdll, name):
            fn(name, restype, argtypes)

    _declare_layers(optional)


def missing_layer_api():
    """None, or why the loaded library cannot run caller-defined layers."""
    if not hasattr(lib(), "rp_model_create_with_layers") or \
            not hasattr(lib(), "rp_loss_create_device_callback"):
        return ("%s predates caller-defined layers (no rp_model_create_with_layers / "
                "rp_loss_create_device_callback); rebuild it" % _LIB_PATH)
    return None


def _declare_base(fn):
    """Status, errors, versions, logging; run configuration: declared with `fn` of _declare."""
    P = POINTER
    st = _STATUS  # rp_status: c_int checked by _status_check

    # -- status, errors, versions, logging ---------------------------------------------------
    fn("rp_version", c_char_p, [])                                   # const char *rp_version(void);
    fn("rp_abi_version", c_int32, [])                                # int32_t rp_abi_version(void);
    fn("rp_torch_version", c_char_p, [])                             # const char *rp_torch_version(void);
    fn("rp_status_string", c_char_p, [c_int])                        # const char *rp_status_string(rp_status status);
    fn("rp_last_error_message", c_char_p, [])                        # const char *rp_last_error_message(void);
    fn("rp_set_log_callback", st, [rp_log_fn, c_int32, c_void_p])    # rp_status rp_set_log_callback(rp_log_fn fn, int32_t min_level, void *user_data);
    fn("rp_set_progress_callback", st, [rp_progress_fn, c_void_p])   # rp_status rp_set_progress_callback(rp_progress_fn fn, void *user_data);
    fn("rp_cuda_device_count", st, [P(c_int32)])                     # rp_status rp_cuda_device_count(int32_t *out_count);

    # -- run configuration ---------------------------------------------------------------------
    fn("rp_run_config_create", st, [P(rp_run_config_p)])             # rp_status rp_run_config_create(rp_run_config **out_config);
    fn("rp_run_config_destroy", None, [rp_run_config_p])             # void rp_run_config_destroy(rp_run_config *config);
    fn("rp_run_config_set_num_microbatch", st,
       [rp_run_config_p, c_int32])                                   # rp_status rp_run_config_set_num_microbatch(rp_run_config *config, int32_t num_microbatch);
    fn("rp_run_config_set_recompute_grain", st,
       [rp_run_config_p, c_int32])                                   # rp_status rp_run_config_set_recompute_grain(rp_run_config *config, int32_t grain);
    fn("rp_run_config_set_output_device", st,
       [rp_run_config_p, c_int32, c_int32])                          # rp_status rp_run_config_set_output_device(rp_run_config *config, int32_t device_type, int32_t device_id);
    fn("rp_run_config_set_input_split_dim", st,
       [rp_run_config_p, c_int32, c_int32])                          # rp_status rp_run_config_set_input_split_dim(rp_run_config *config, int32_t input_index, int32_t dim);
    fn("rp_run_config_set_label_split_dim", st,
       [rp_run_config_p, c_int32])                                   # rp_status rp_run_config_set_label_split_dim(rp_run_config *config, int32_t dim);
    fn("rp_run_config_set_split_callback", st,
       [rp_run_config_p, rp_split_fn, c_void_p])                     # rp_status rp_run_config_set_split_callback(rp_run_config *config, rp_split_fn fn, void *user_data);
    fn("rp_run_config_set_merge_output", st,
       [rp_run_config_p, c_int32])                                   # rp_status rp_run_config_set_merge_output(rp_run_config *config, int32_t merge);
    fn("rp_run_config_get_num_microbatch", st,
       [P(c_int32), rp_run_config_p])                                # rp_status rp_run_config_get_num_microbatch(int32_t *out_num_microbatch, const rp_run_config *config);
    fn("rp_run_config_get_recompute_grain", st,
       [P(c_int32), rp_run_config_p])                                # rp_status rp_run_config_get_recompute_grain(int32_t *out_grain, const rp_run_config *config);
    fn("rp_run_config_get_output_device", st,
       [P(c_int32), P(c_int32), rp_run_config_p])                    # rp_status rp_run_config_get_output_device(int32_t *out_device_type, int32_t *out_device_id, const rp_run_config *config);
    fn("rp_run_config_get_merge_output", st,
       [P(c_int32), rp_run_config_p])                                # rp_status rp_run_config_get_merge_output(int32_t *out_merge, const rp_run_config *config);


def _declare_model(fn):
    """Model options, model lifetime and queries: declared with `fn` of _declare."""
    P = POINTER
    st = _STATUS  # rp_status: c_int checked by _status_check

    # -- model options and model lifetime ------------------------------------------------------
    fn("rp_model_options_create", st, [P(rp_model_options_p)])       # rp_status rp_model_options_create(rp_model_options **out_options);
    fn("rp_model_options_destroy", None, [rp_model_options_p])       # void rp_model_options_destroy(rp_model_options *options);
    fn("rp_model_options_set_model_dtype", st,
       [rp_model_options_p, c_int32])                                # rp_status rp_model_options_set_model_dtype(rp_model_options *options, int32_t dtype);
    fn("rp_model_options_set_optim_dtype", st,
       [rp_model_options_p, c_int32])                                # rp_status rp_model_options_set_optim_dtype(rp_model_options *options, int32_t dtype);
    fn("rp_model_options_set_pin_mode", st,
       [rp_model_options_p, c_int32])                                # rp_status rp_model_options_set_pin_mode(rp_model_options *options, int32_t pin_mode);
    fn("rp_model_options_set_host_memory_mode", st,
       [rp_model_options_p, c_int32])                                # rp_status rp_model_options_set_host_memory_mode(rp_model_options *options, int32_t mode);
    fn("rp_model_options_set_run_config", st,
       [rp_model_options_p, rp_run_config_p])                        # rp_status rp_model_options_set_run_config(rp_model_options *options, const rp_run_config *config);
    fn("rp_model_options_set_grad_scaler", st,
       [rp_model_options_p, c_double, c_int32])                      # rp_status rp_model_options_set_grad_scaler(rp_model_options *options, double initial_scale, int32_t growth_interval);
    fn("rp_model_options_set_gpu_memory_cap", st,
       [rp_model_options_p, c_int64])                                # rp_status rp_model_options_set_gpu_memory_cap(rp_model_options *options, int64_t bytes);
    fn("rp_model_options_set_seed", st,
       [rp_model_options_p, c_uint64])                               # rp_status rp_model_options_set_seed(rp_model_options *options, uint64_t seed);
    fn("rp_model_options_set_skip_nonfinite_steps", st,
       [rp_model_options_p, c_int32])                                # rp_status rp_model_options_set_skip_nonfinite_steps(rp_model_options *options, int32_t skip);
    fn("rp_model_options_set_name", st,
       [rp_model_options_p, c_char_p])                               # rp_status rp_model_options_set_name(rp_model_options *options, const char *name);
    fn("rp_model_options_set_devices", st,
       [rp_model_options_p, c_int32, c_int32])                       # rp_status rp_model_options_set_devices(rp_model_options *options, int32_t kind, int32_t num_devices);
    fn("rp_model_options_set_data_parallel", st,
       [rp_model_options_p, c_int32, c_int32, c_char_p, c_int64])    # rp_status rp_model_options_set_data_parallel(rp_model_options *options, int32_t rank, int32_t world_size, const char *rendezvous, int64_t timeout_ms);
    fn("rp_model_options_set_global_loss", st,
       [rp_model_options_p, c_int32])                                # rp_status rp_model_options_set_global_loss(rp_model_options *options, int32_t global);
    fn("rp_model_options_set_lora", st,
       [rp_model_options_p, c_int32, c_double, c_double, c_char_p])  # rp_status rp_model_options_set_lora(rp_model_options *options, int32_t rank, double alpha, double dropout, const char *target_modules);
    fn("rp_data_parallel_available", st, [P(c_int32)])               # rp_status rp_data_parallel_available(int32_t *out_available);
    fn("rp_model_options_set_stage_plan", st,
       [rp_model_options_p, P(c_int32), c_size_t])                   # rp_status rp_model_options_set_stage_plan(rp_model_options *options, const int32_t *layers_per_stage, size_t n);
    fn("rp_model_create", st,
       [P(rp_model_p), c_char_p, rp_model_options_p])                # rp_status rp_model_create(rp_model **out_model, const char *spec_json, const rp_model_options *options);
    fn("rp_model_destroy", None, [rp_model_p])                       # void rp_model_destroy(rp_model *model);
    fn("rp_model_num_layers", st, [P(c_int32), rp_model_p])          # rp_status rp_model_num_layers(int32_t *out_count, const rp_model *model);
    fn("rp_model_num_stages", st, [P(c_int32), rp_model_p])          # rp_status rp_model_num_stages(int32_t *out_count, const rp_model *model);
    fn("rp_model_num_devices", st, [P(c_int32), rp_model_p])         # rp_status rp_model_num_devices(int32_t *out_count, const rp_model *model);
    fn("rp_model_stage_plan", st,
       [P(c_int32), P(c_int32), c_int32, rp_model_p])                # rp_status rp_model_stage_plan(int32_t *out_layers_per_stage, int32_t *out_num_stages, int32_t capacity, const rp_model *model);
    fn("rp_model_plan_stages", st,
       [P(c_int32), P(c_int32), c_int32, rp_model_p, c_int64, c_int32])  # rp_status rp_model_plan_stages(int32_t *out_layers_per_stage, int32_t *out_num_stages, int32_t capacity, const rp_model *model, int64_t max_stage_bytes, int32_t min_stages);
    fn("rp_model_set_stage_plan", st,
       [rp_model_p, P(c_int32), c_size_t])                           # rp_status rp_model_set_stage_plan(rp_model *model, const int32_t *layers_per_stage, size_t n);
    fn("rp_model_set_backward_stage_plan", st,
       [rp_model_p, P(c_int32), c_size_t])                           # rp_status rp_model_set_backward_stage_plan(rp_model *model, const int32_t *layers_per_stage, size_t n);
    fn("rp_model_backward_stage_plan", st,
       [P(c_int32), P(c_int32), c_int32, rp_model_p])                # rp_status rp_model_backward_stage_plan(int32_t *out_layers_per_stage, int32_t *out_num_stages, int32_t capacity, const rp_model *model);
    fn("rp_model_resolve_run_config", st,
       [P(rp_run_config_p), rp_model_p, rp_run_config_p])            # rp_status rp_model_resolve_run_config(rp_run_config **out_config, const rp_model *model, const rp_run_config *call);
    fn("rp_model_step_count", st, [P(c_int64), rp_model_p])          # rp_status rp_model_step_count(int64_t *out_count, const rp_model *model);
    fn("rp_model_grad_scale", st, [P(c_double), P(c_int64), rp_model_p])  # rp_status rp_model_grad_scale(double *out_scale, int64_t *out_skipped_steps, const rp_model *model);
    fn("rp_model_nonfinite_counts", st,
       [P(c_int64), P(c_int64), rp_model_p])                         # rp_status rp_model_nonfinite_counts(int64_t *out_nonfinite_losses, int64_t *out_skipped_steps, const rp_model *model);
    fn("rp_model_set_grad_scaler", st,
       [rp_model_p, c_double, c_int32])                              # rp_status rp_model_set_grad_scaler(rp_model *model, double initial_scale, int32_t growth_interval);
    fn("rp_model_set_skip_nonfinite_steps", st,
       [rp_model_p, c_int32])                                        # rp_status rp_model_set_skip_nonfinite_steps(rp_model *model, int32_t skip);
    fn("rp_model_gpu_memory_cap", st, [P(c_int64), rp_model_p])      # rp_status rp_model_gpu_memory_cap(int64_t *out_bytes, const rp_model *model);
    fn("rp_model_data_parallel", st,
       [P(c_int32), P(c_int32), rp_model_p])                         # rp_status rp_model_data_parallel(int32_t *out_rank, int32_t *out_world_size, const rp_model *model);
    fn("rp_model_host_state_bytes", st,
       [P(c_int64), P(c_int64), rp_model_p])                         # rp_status rp_model_host_state_bytes(int64_t *out_bytes, int64_t *out_elements, const rp_model *model);
    fn("rp_model_trace_json", st, [P(c_char_p), rp_model_p])         # rp_status rp_model_trace_json(const char **out_json, rp_model *model);
    fn("rp_cuda_memory_stats", st, [P(c_int64), P(c_int64), c_int32])  # rp_status rp_cuda_memory_stats(int64_t *out_allocated_bytes, int64_t *out_peak_bytes, int32_t device);
    fn("rp_cuda_reset_peak_memory", st, [c_int32])                    # rp_status rp_cuda_reset_peak_memory(int32_t device);


def _declare_calls(fn):
    """Tensor lists, losses, forward (+ backward), optimizer: declared with `fn` of _declare."""
    P = POINTER
    st = _STATUS  # rp_status: c_int checked by _status_check

    # -- tensor lists --------------------------------------------------------------------------
    fn("rp_tensor_list_size", st, [P(c_size_t), rp_tensor_list_p])   # rp_status rp_tensor_list_size(size_t *out_size, const rp_tensor_list *list);
    fn("rp_tensor_list_get", st,
       [P(c_void_p), rp_tensor_list_p, c_size_t])                    # rp_status rp_tensor_list_get(DLManagedTensor **out_tensor, const rp_tensor_list *list, size_t index);
    fn("rp_tensor_list_destroy", None, [rp_tensor_list_p])           # void rp_tensor_list_destroy(rp_tensor_list *list);
    fn("rp_split_microbatches", st,
       [P(rp_tensor_list_p), c_void_p, c_int32, c_int32])            # rp_status rp_split_microbatches(rp_tensor_list **out_pieces, const DLManagedTensor *tensor, int32_t dim, int32_t num_microbatch);

    # -- losses --------------------------------------------------------------------------------
    fn("rp_loss_create", st, [P(rp_loss_p), c_int32])                # rp_status rp_loss_create(rp_loss **out_loss, int32_t kind);
    fn("rp_loss_create_callback", st,
       [P(rp_loss_p), rp_loss_fn, c_void_p])                         # rp_status rp_loss_create_callback(rp_loss **out_loss, rp_loss_fn fn, void *user_data);
    fn("rp_loss_set_scale", st, [rp_loss_p, c_double])               # rp_status rp_loss_set_scale(rp_loss *loss, double scale);
    fn("rp_loss_destroy", None, [rp_loss_p])                         # void rp_loss_destroy(rp_loss *loss);

    # -- forward and fused forward + backward --------------------------------------------------
    fn("rp_forward", st,
       [P(rp_tensor_list_p), rp_model_p, P(c_void_p), c_size_t,
        rp_run_config_p])                                            # rp_status rp_forward(rp_tensor_list **out_outputs, rp_model *model, const DLManagedTensor *const *inputs, size_t n_inputs, const rp_run_config *config);
    fn("rp_forward_train", st,
       [P(rp_tensor_list_p), rp_model_p, P(c_void_p), c_size_t,
        rp_run_config_p])                                            # rp_status rp_forward_train(rp_tensor_list **out_outputs, rp_model *model, const DLManagedTensor *const *inputs, size_t n_inputs, const rp_run_config *config);
    fn("rp_backward", st,
       [rp_model_p, P(c_void_p), c_size_t])                          # rp_status rp_backward(rp_model *model, const DLManagedTensor *const *output_grads, size_t n_grads);
    fn("rp_backward_input_grads", st,
       [P(rp_tensor_list_p), rp_model_p, P(c_void_p), c_size_t])     # rp_status rp_backward_input_grads(rp_tensor_list **out_input_grads, rp_model *model, const DLManagedTensor *const *output_grads, size_t n_grads);
    fn("rp_forward_backward", st,
       [P(c_double), P(rp_tensor_list_p), rp_model_p, P(c_void_p), c_size_t, c_void_p,
        rp_loss_p, rp_run_config_p])                                 # rp_status rp_forward_backward(double *out_loss, rp_tensor_list **out_outputs, rp_model *model, const DLManagedTensor *const *inputs, size_t n_inputs, const DLManagedTensor *labels, const rp_loss *loss, const rp_run_config *config);

    # -- optimizer -----------------------------------------------------------------------------
    fn("rp_optimizer_create", st, [P(rp_optimizer_p), c_int32])      # rp_status rp_optimizer_create(rp_optimizer **out_optimizer, int32_t kind);
    fn("rp_optimizer_destroy", None, [rp_optimizer_p])               # void rp_optimizer_destroy(rp_optimizer *optimizer);
    fn("rp_optimizer_set_learning_rate", st,
       [rp_optimizer_p, c_double])                                   # rp_status rp_optimizer_set_learning_rate(rp_optimizer *optimizer, double lr);
    fn("rp_optimizer_set_betas", st,
       [rp_optimizer_p, c_double, c_double])                         # rp_status rp_optimizer_set_betas(rp_optimizer *optimizer, double beta1, double beta2);
    fn("rp_optimizer_set_eps", st, [rp_optimizer_p, c_double])       # rp_status rp_optimizer_set_eps(rp_optimizer *optimizer, double eps);
    fn("rp_optimizer_set_weight_decay", st,
       [rp_optimizer_p, c_double])                                   # rp_status rp_optimizer_set_weight_decay(rp_optimizer *optimizer, double weight_decay);
    fn("rp_optimizer_set_momentum", st,
       [rp_optimizer_p, c_double])                                   # rp_status rp_optimizer_set_momentum(rp_optimizer *optimizer, double momentum);
    fn("rp_adam_apply", st,
       [P(c_void_p), P(c_void_p), P(c_void_p), P(c_void_p), P(c_int64), c_size_t, c_double,
        c_double, c_double, c_double, c_double, c_int32])             # rp_status rp_adam_apply(DLManagedTensor *const *params, const DLManagedTensor *const *grads, DLManagedTensor *const *exp_avgs, DLManagedTensor *const *exp_avg_sqs, const int64_t *steps, size_t n_tensors, double lr, double beta1, double beta2, double eps, double weight_decay, int32_t decoupled_weight_decay);
    fn("rp_step", st, [rp_model_p, rp_optimizer_p, c_int32])         # rp_status rp_step(rp_model *model, const rp_optimizer *optimizer, int32_t is_async);
    fn("rp_step_callback", st,
       [rp_model_p, rp_step_fn, c_void_p, c_int32])                  # rp_status rp_step_callback(rp_model *model, rp_step_fn fn, void *user_data, int32_t is_async);
    fn("rp_model_set_step_in_call", st,
       [rp_model_p, rp_optimizer_p])                                 # rp_status rp_model_set_step_in_call(rp_model *model, const rp_optimizer *optimizer);
    fn("rp_model_step_in_call", st, [P(c_int32), rp_model_p])        # rp_status rp_model_step_in_call(int32_t *out_enabled, const rp_model *model);
    fn("rp_synchronize", st, [rp_model_p])                           # rp_status rp_synchronize(rp_model *model);
    fn("rp_zero_grad", st, [rp_model_p])                             # rp_status rp_zero_grad(rp_model *model);


def _declare_params(fn):
    """Parameters, weights on disk, Hugging Face models: declared with `fn` of _declare."""
    P = POINTER
    st = _STATUS  # rp_status: c_int checked by _status_check

    # -- parameters ----------------------------------------------------------------------------
    # The model argument is c_void_p here (not rp_model_p): step callbacks receive the model as
    # a bare pointer and call these on it.
    fn("rp_param_count", st, [P(c_size_t), c_void_p])                # rp_status rp_param_count(size_t *out_count, const rp_model *model);
    fn("rp_param_name", st, [P(c_char_p), c_void_p, c_size_t])       # rp_status rp_param_name(const char **out_name, const rp_model *model, size_t index);
    fn("rp_param_find", st, [P(c_size_t), c_void_p, c_char_p])       # rp_status rp_param_find(size_t *out_index, const rp_model *model, const char *name);
    fn("rp_param_hf_name", st, [P(c_char_p), c_void_p, c_size_t])    # rp_status rp_param_hf_name(const char **out_name, const rp_model *model, size_t index);
    fn("rp_param_shape", st,
       [P(c_int64), P(c_int32), c_int32, c_void_p, c_size_t])        # rp_status rp_param_shape(int64_t *out_shape, int32_t *out_ndim, int32_t capacity, const rp_model *model, size_t index);
    fn("rp_param_master", st, [P(c_void_p), c_void_p, c_size_t])     # rp_status rp_param_master(DLManagedTensor **out_tensor, rp_model *model, size_t index);
    fn("rp_param_grad", st, [P(c_void_p), c_void_p, c_size_t])       # rp_status rp_param_grad(DLManagedTensor **out_tensor, rp_model *model, size_t index);

    # -- weights on disk -----------------------------------------------------------------------
    fn("rp_model_save", st, [rp_model_p, c_char_p])                  # rp_status rp_model_save(rp_model *model, const char *path);
    fn("rp_model_load", st, [rp_model_p, c_char_p])                  # rp_status rp_model_load(rp_model *model, const char *path);

    # -- Hugging Face models -------------------------------------------------------------------
    fn("rp_model_create_from_hf", st,
       [P(rp_model_p), c_char_p, rp_model_options_p])                # rp_status rp_model_create_from_hf(rp_model **out_model, const char *dir, const rp_model_options *options);
    fn("rp_model_create_from_hf_config", st,
       [P(rp_model_p), c_char_p, rp_model_options_p])                # rp_status rp_model_create_from_hf_config(rp_model **out_model, const char *config_json, const rp_model_options *options);
    fn("rp_model_load_hf", st, [rp_model_p, c_char_p])               # rp_status rp_model_load_hf(rp_model *model, const char *dir);
    fn("rp_model_save_hf", st, [rp_model_p, c_char_p])               # rp_status rp_model_save_hf(rp_model *model, const char *dir);
    fn("rp_model_lora", st, [P(c_int32), P(c_double), P(c_double), P(c_char_p), c_void_p])  # rp_status rp_model_lora(int32_t *out_rank, double *out_alpha, double *out_dropout, const char **out_target_modules, const rp_model *model);
    fn("rp_model_save_lora", st, [rp_model_p, c_char_p, c_char_p])   # rp_status rp_model_save_lora(rp_model *model, const char *dir, const char *base_model);
    fn("rp_model_load_lora", st, [rp_model_p, c_char_p])             # rp_status rp_model_load_lora(rp_model *model, const char *dir);


def _declare_layers(fn):
    """Caller-defined layers, device losses, tensor lists the caller fills, parameter kinds,
    which gradients were received: declared with `fn` of _declare."""
    P = POINTER
    st = _STATUS  # rp_status: c_int checked by _status_check

    fn("rp_layer_def_create", st,
       [P(rp_layer_def_p), c_char_p, rp_layer_forward_fn, rp_layer_backward_fn,
        rp_layer_release_fn, c_void_p])                              # rp_status rp_layer_def_create(rp_layer_def **out_def, const char *type_name, rp_layer_forward_fn forward, rp_layer_backward_fn backward, rp_layer_release_fn release, void *user_data);
    fn("rp_layer_def_destroy", None, [rp_layer_def_p])               # void rp_layer_def_destroy(rp_layer_def *def);
    fn("rp_layer_def_add_param", st,
       [rp_layer_def_p, c_char_p, c_void_p, c_int32])                # rp_status rp_layer_def_add_param(rp_layer_def *def, const char *name, const DLManagedTensor *initial, int32_t trainable);
    fn("rp_layer_def_add_tied_param", st,
       [rp_layer_def_p, c_char_p, c_char_p])                         # rp_status rp_layer_def_add_tied_param(rp_layer_def *def, const char *name, const char *tied_to);
    fn("rp_layer_def_add_buffer", st,
       [rp_layer_def_p, c_char_p, c_void_p])                         # rp_status rp_layer_def_add_buffer(rp_layer_def *def, const char *name, const DLManagedTensor *initial);
    fn("rp_layer_def_set_cost", st, [rp_layer_def_p, c_double])      # rp_status rp_layer_def_set_cost(rp_layer_def *def, double cost);
    fn("rp_layer_def_set_activation_bytes", st, [rp_layer_def_p, c_double])  # rp_status rp_layer_def_set_activation_bytes(rp_layer_def *def, double bytes_per_token);
    fn("rp_layer_call_info", st,
       [P(c_int32), P(c_int32), P(c_int32), P(c_void_p), P(c_uint64), P(c_int32), P(c_int32),
        c_void_p])                                                   # rp_status rp_layer_call_info(int32_t *out_phase, int32_t *out_device_type, int32_t *out_device_id, void **out_stream, uint64_t *out_seed, int32_t *out_microbatch, int32_t *out_training, const rp_layer_call *call);
    fn("rp_layer_call_tensors", st,
       [P(P(c_void_p)), P(c_size_t), P(P(c_void_p)), P(c_size_t), c_void_p])  # rp_status rp_layer_call_tensors(const DLManagedTensor *const **out_params, size_t *out_n_params, const DLManagedTensor *const **out_buffers, size_t *out_n_buffers, const rp_layer_call *call);
    fn("rp_tensor_list_create", st, [P(rp_tensor_list_p)])           # rp_status rp_tensor_list_create(rp_tensor_list **out_list);
    fn("rp_tensor_list_push", st, [c_void_p, c_void_p])              # rp_status rp_tensor_list_push(rp_tensor_list *list, DLManagedTensor *tensor);
    fn("rp_loss_create_device_callback", st,
       [P(rp_loss_p), rp_device_loss_fn, c_void_p])                  # rp_status rp_loss_create_device_callback(rp_loss **out_loss, rp_device_loss_fn fn, void *user_data);
    fn("rp_model_create_with_layers", st,
       [P(rp_model_p), c_char_p, P(rp_layer_def_p), c_size_t,
        rp_model_options_p])                                         # rp_status rp_model_create_with_layers(rp_model **out_model, const char *spec_json, const rp_layer_def *const *defs, size_t n_defs, const rp_model_options *options);
    fn("rp_param_kind_of", st, [P(c_int32), c_void_p, c_size_t])     # rp_status rp_param_kind_of(int32_t *out_kind, const rp_model *model, size_t index);
    fn("rp_param_grad_received", st, [P(c_int32), c_void_p, c_size_t])  # rp_status rp_param_grad_received(int32_t *out_received, const rp_model *model, size_t index);


# Marker for "returns rp_status" in _declare (c_int32 is c_int, so the type cannot tell).
_STATUS = object()

_LIB = None
_LIB_PATH = None
_LOCK = threading.Lock()
_ON_LOAD = []


def on_load(hook):
    """Call ``hook()`` once the library is loaded and declared (now, if it already is): how the
    package installs its log and progress sinks before any call can report."""
    _ON_LOAD.append(hook)
    if _LIB is not None:
        hook()


def _torch_release(version):
    """"2.11.0" from "2.11.0+cu130" or "2.11.0a0+git1234": the release part of a version."""
    match = re.match(r"\d+(\.\d+)*", version)
    return match.group(0) if match else version


def _check_torch_version(cdll, candidate):
    """Refuse a library built against another torch than the one imported: libtorch's C++ ABI
    changes between releases, so such a library crashes or misbehaves instead of failing."""
    built = cdll.rp_torch_version().decode()
    if _torch_release(built) != _torch_release(torch.__version__):
        raise LibraryNotFoundError(
            "%s was built against torch %s, but this Python has torch %s (%s); install "
            "torch==%s, or rebuild RoundPipe against this torch (pip install ./bindings/python "
            "from the RoundPipe sources)"
            % (candidate, built, torch.__version__, os.path.dirname(torch.__file__), built))


def _torch_hint(exc):
    """A hint for a load failure that a library built against another torch causes."""
    if "undefined symbol" not in str(exc):
        return ""
    return ("  (a library built against another torch fails this way; this Python has torch %s "
            "at %s)" % (torch.__version__, os.path.dirname(torch.__file__)))


def lib():
    """The loaded, declared library (loaded on first call)."""
    if _LIB is None:
        load_library()
    return _LIB


def load_library(path=None):
    """Load libroundpipe (from `path` if given, else from the search order in this module's
    docstring), check its ABI version and return its path. Idempotent: once a library is
    loaded, later calls return its path."""
    global _LIB, _LIB_PATH
    with _LOCK:
        if _LIB is not None:
            return _LIB_PATH
        candidates = [("argument", os.fspath(path))] if path is not None else candidate_paths()
        tried = []
        for origin, candidate in candidates:
            is_bare_name = os.sep not in candidate
            if not is_bare_name and not os.path.exists(candidate):
                tried.append("  %s (%s): no such file" % (candidate, origin))
                continue
            try:
                cdll = ctypes.CDLL(candidate)
            except OSError as exc:
                tried.append("  %s (%s): %s%s" % (candidate, origin, exc, _torch_hint(exc)))
                continue
            missing = [n for n in ("rp_abi_version", "rp_model_create") if not hasattr(cdll, n)]
            if missing:
                tried.append("  %s (%s): not libroundpipe (no %s)"
                             % (candidate, origin, ", ".join(missing)))
                continue
            cdll.rp_abi_version.restype = c_int32
            cdll.rp_abi_version.argtypes = []
            abi = cdll.rp_abi_version()
            if abi != ABI_VERSION:
                raise LibraryNotFoundError(
                    "%s has ABI version %d, this binding needs %d; rebuild the library or "
                    "install the matching binding" % (candidate, abi, ABI_VERSION))
            try:
                _declare(cdll)
            except AttributeError as exc:
                raise LibraryNotFoundError("%s lacks a function of roundpipe.h: %s"
                                           % (candidate, exc)) from None
            _check_torch_version(cdll, candidate)
            _LIB = cdll
            _LIB_PATH = candidate
            for hook in _ON_LOAD:
                hook()
            return candidate
        raise LibraryNotFoundError(
            "cannot load libroundpipe.so; set ROUNDPIPE_LIBRARY to its path. Tried:\n"
            + "\n".join(tried))


def library_path():
    """Path of the loaded library (loading it if needed)."""
    lib()
    return _LIB_PATH


def status_string(status):
    """The library's name for an rp_status."""
    s = lib().rp_status_string(int(status))
    return s.decode() if s else ""


__all__ = ["lib", "load_library", "library_path", "candidate_paths", "ABI_VERSION", "Status"]
