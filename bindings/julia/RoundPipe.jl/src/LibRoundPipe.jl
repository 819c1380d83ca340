"""
    LibRoundPipe

Raw `ccall` layer of RoundPipe: one Julia function per C function of `include/roundpipe.h`, same
name, same parameters in the same order, plus the header's types, structs and constants. Nothing
here checks a status or manages memory; that is `RoundPipe`'s job. Each function carries the C
prototype above it.

`tools/abi/check_bindings.py` reads this file (no Julia runtime is needed) and compares every
`ccall` with the header as `swig -xml` sees it: the same functions, the same number of
parameters, compatible types, the same struct layouts and constant values.

The library is found on first use: `ENV["ROUNDPIPE_LIBRARY"]` (a path to libroundpipe.so), then
`ENV["ROUNDPIPE_LIB_DIR"]/libroundpipe.so`, then the build tree of this repository
(`<repo>/build/libroundpipe.so`), then the system loader's search path.
"""
module LibRoundPipe

using Libdl

const _LIBPATH = Ref{String}("")

function _candidates()
    c = String[]
    haskey(ENV, "ROUNDPIPE_LIBRARY") && push!(c, ENV["ROUNDPIPE_LIBRARY"])
    haskey(ENV, "ROUNDPIPE_LIB_DIR") && push!(c, joinpath(ENV["ROUNDPIPE_LIB_DIR"], "libroundpipe.so"))
    # bindings/julia/RoundPipe.jl/src -> repository root
    push!(c, normpath(joinpath(@__DIR__, "..", "..", "..", "..", "build", "libroundpipe.so")))
    push!(c, "libroundpipe.so.1")
    push!(c, "libroundpipe")
    return c
end

"""
    libroundpipe() -> String

Path of the RoundPipe shared library, found (and opened once, to fail early with a clear
message) on first use.
"""
function libroundpipe()
    isempty(_LIBPATH[]) || return _LIBPATH[]
    tried = String[]
    for cand in _candidates()
        h = Libdl.dlopen(cand, Libdl.RTLD_LAZY | Libdl.RTLD_GLOBAL; throw_error=false)
        if h === nothing
            push!(tried, cand)
            continue
        end
        _LIBPATH[] = Libdl.dlpath(h)
        return _LIBPATH[]
    end
    error("RoundPipe: cannot load libroundpipe.so; tried:\n  " * join(tried, "\n  ") *
          "\nSet ENV[\"ROUNDPIPE_LIBRARY\"] to the library's path (or build it: cmake --build build).")
end

# -------------------------------------------------------------------------------------------
# DLPack 1.x (isbits structs have the C layout)
# -------------------------------------------------------------------------------------------

const DLPACK_MAJOR_VERSION = 1
const DLPACK_MINOR_VERSION = 0

struct DLPackVersion
    major::UInt32
    minor::UInt32
end

const DLDeviceType = Cint
const kDLCPU = 1
const kDLCUDA = 2
const kDLCUDAHost = 3
const kDLOpenCL = 4
const kDLVulkan = 7
const kDLMetal = 8
const kDLVPI = 9
const kDLROCM = 10
const kDLROCMHost = 11
const kDLExtDev = 12
const kDLCUDAManaged = 13
const kDLOneAPI = 14
const kDLWebGPU = 15
const kDLHexagon = 16
const kDLMAIA = 17

struct DLDevice
    device_type::DLDeviceType
    device_id::Int32
end

const DLDataTypeCode = Cint
const kDLInt = 0
const kDLUInt = 1
const kDLFloat = 2
const kDLOpaqueHandle = 3
const kDLBfloat = 4
const kDLComplex = 5
const kDLBool = 6

struct DLDataType
    code::UInt8
    bits::UInt8
    lanes::UInt16
end

struct DLTensor
    data::Ptr{Cvoid}
    device::DLDevice
    ndim::Int32
    dtype::DLDataType
    shape::Ptr{Int64}
    strides::Ptr{Int64}
    byte_offset::UInt64
end

struct DLManagedTensor
    dl_tensor::DLTensor
    manager_ctx::Ptr{Cvoid}
    deleter::Ptr{Cvoid}  # void (*)(DLManagedTensor *self)
end

struct DLManagedTensorVersioned
    version::DLPackVersion
    manager_ctx::Ptr{Cvoid}
    deleter::Ptr{Cvoid}  # void (*)(DLManagedTensorVersioned *self)
    flags::UInt64
    dl_tensor::DLTensor
end

# -------------------------------------------------------------------------------------------
# Status, log levels and option enumerations (C enums are Cint)
# -------------------------------------------------------------------------------------------

const rp_status = Cint
const RP_OK = 0
const RP_ERR_INVALID_ARGUMENT = -1
const RP_ERR_OUT_OF_MEMORY = -2
const RP_ERR_IO = -3
const RP_ERR_CUDA = -4
const RP_ERR_CALLBACK = -5
const RP_ERR_STATE = -6
const RP_ERR_INTERNAL = -7

const rp_log_level = Cint
const RP_LOG_DEBUG = 0
const RP_LOG_INFO = 1
const RP_LOG_WARN = 2
const RP_LOG_ERROR = 3

const rp_dtype = Cint
const RP_DTYPE_DEFAULT = 0
const RP_DTYPE_F32 = 1
const RP_DTYPE_BF16 = 2
const RP_DTYPE_F16 = 3

const rp_pin_mode = Cint
const RP_PIN_ALLOC = 0
const RP_PIN_REGISTER = 1
const RP_PIN_OFF = 2

const rp_host_memory_mode = Cint
const RP_HOST_MEMORY_STANDARD = 0
const RP_HOST_MEMORY_SAVING = 1

const rp_device_kind = Cint
const RP_DEVICE_AUTO = 0
const RP_DEVICE_CPU = 1
const RP_DEVICE_CUDA = 2

const rp_recompute_grain = Cint
const RP_GRAIN_DEFAULT = 0
const RP_GRAIN_STAGE = 1
const RP_GRAIN_LAYER = 2

const RP_SPLIT_REPLICATE = -1

const rp_loss_kind = Cint
const RP_LOSS_OUTPUT = 0
const RP_LOSS_MSE = 1
const RP_LOSS_CROSS_ENTROPY = 2
const RP_LOSS_CAUSAL_LM = 3

const rp_optimizer_kind = Cint
const RP_OPTIMIZER_ADAMW = 0
const RP_OPTIMIZER_SGD = 1

"ABI version this package was written for; compared with `rp_abi_version()` at load."
const rp_layer_phase = Cint
const RP_PHASE_FORWARD = 0
const RP_PHASE_RECOMPUTE = 1
const RP_PHASE_TAIL = 2

const rp_param_kind = Cint
const RP_PARAM_TRAINABLE = 0
const RP_PARAM_FROZEN = 1
const RP_PARAM_BUFFER = 2

const RP_ABI_VERSION = 1

# -------------------------------------------------------------------------------------------
# Opaque handles: only pointers to them exist (Ptr{rp_model} and so on)
# -------------------------------------------------------------------------------------------

mutable struct rp_run_config end
mutable struct rp_model_options end
mutable struct rp_model end
mutable struct rp_tensor_list end
mutable struct rp_loss end
mutable struct rp_optimizer end
mutable struct rp_layer_def end
mutable struct rp_layer_call end  # lent to callbacks only, valid during the callback

# -------------------------------------------------------------------------------------------
# Callback types: C function pointers, made with @cfunction. Signatures:
#   rp_log_fn:   void    (int32_t level, const char *message, void *user_data)
#   rp_progress_fn: void (const char *what, int64_t done, int64_t total, void *user_data)
#   rp_split_fn: int32_t (DLManagedTensor **out_pieces, const DLManagedTensor *const *inputs,
#                         size_t n_inputs, int32_t num_microbatch, void *user_data)
#   rp_loss_fn:  int32_t (double *out_loss, DLManagedTensor **out_grad,
#                         const DLManagedTensor *outputs, const DLManagedTensor *labels,
#                         int32_t microbatch, void *user_data)
#   rp_step_fn:  int32_t (rp_model *model, void *user_data)
#   rp_layer_forward_fn:  int32_t (rp_tensor_list *out_outputs, void **inout_context,
#                                  const rp_layer_call *call,
#                                  const DLManagedTensor *const *inputs, size_t n_inputs,
#                                  void *user_data)
#   rp_layer_backward_fn: int32_t (rp_tensor_list *out_input_grads,
#                                  rp_tensor_list *out_param_grads, void *context,
#                                  const rp_layer_call *call,
#                                  const DLManagedTensor *const *output_grads, size_t n_outputs,
#                                  void *user_data)
#   rp_layer_release_fn:  void    (void *context, void *user_data)
#   rp_device_loss_fn:    int32_t (DLManagedTensor **out_loss, rp_tensor_list *out_grads,
#                                  const rp_layer_call *call,
#                                  const DLManagedTensor *const *outputs, size_t n_outputs,
#                                  const DLManagedTensor *labels, void *user_data)
# -------------------------------------------------------------------------------------------

const rp_log_fn = Ptr{Cvoid}
const rp_progress_fn = Ptr{Cvoid}
const rp_split_fn = Ptr{Cvoid}
const rp_loss_fn = Ptr{Cvoid}
const rp_step_fn = Ptr{Cvoid}
const rp_layer_forward_fn = Ptr{Cvoid}
const rp_layer_backward_fn = Ptr{Cvoid}
const rp_layer_release_fn = Ptr{Cvoid}
const rp_device_loss_fn = Ptr{Cvoid}

# -------------------------------------------------------------------------------------------
# Functions, in the header's order
# -------------------------------------------------------------------------------------------

# const char *rp_version(void);
rp_version() = ccall((:rp_version, libroundpipe()), Cstring, ())

# int32_t rp_abi_version(void);
rp_abi_version() = ccall((:rp_abi_version, libroundpipe()), Int32, ())

# const char *rp_torch_version(void);
rp_torch_version() = ccall((:rp_torch_version, libroundpipe()), Cstring, ())

# const char *rp_status_string(rp_status status);
rp_status_string(status) = ccall((:rp_status_string, libroundpipe()), Cstring, (rp_status,), status)

# const char *rp_last_error_message(void);
rp_last_error_message() = ccall((:rp_last_error_message, libroundpipe()), Cstring, ())

# rp_status rp_set_log_callback(rp_log_fn fn, int32_t min_level, void *user_data);
rp_set_log_callback(fn, min_level, user_data) =
    ccall((:rp_set_log_callback, libroundpipe()), rp_status,
          (rp_log_fn, Int32, Ptr{Cvoid}),
          fn, min_level, user_data)

# rp_status rp_set_progress_callback(rp_progress_fn fn, void *user_data);
rp_set_progress_callback(fn, user_data) =
    ccall((:rp_set_progress_callback, libroundpipe()), rp_status,
          (rp_progress_fn, Ptr{Cvoid}),
          fn, user_data)

# rp_status rp_cuda_device_count(int32_t *out_count);
rp_cuda_device_count(out_count) =
    ccall((:rp_cuda_device_count, libroundpipe()), rp_status,
          (Ptr{Int32},),
          out_count)

# rp_status rp_run_config_create(rp_run_config **out_config);
rp_run_config_create(out_config) =
    ccall((:rp_run_config_create, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_run_config}},),
          out_config)

# void rp_run_config_destroy(rp_run_config *config);
rp_run_config_destroy(config) =
    ccall((:rp_run_config_destroy, libroundpipe()), Cvoid,
          (Ptr{rp_run_config},),
          config)

# rp_status rp_run_config_set_num_microbatch(rp_run_config *config, int32_t num_microbatch);
rp_run_config_set_num_microbatch(config, num_microbatch) =
    ccall((:rp_run_config_set_num_microbatch, libroundpipe()), rp_status,
          (Ptr{rp_run_config}, Int32),
          config, num_microbatch)

# rp_status rp_run_config_set_recompute_grain(rp_run_config *config, int32_t grain);
rp_run_config_set_recompute_grain(config, grain) =
    ccall((:rp_run_config_set_recompute_grain, libroundpipe()), rp_status,
          (Ptr{rp_run_config}, Int32),
          config, grain)

# rp_status rp_run_config_set_output_device(rp_run_config *config, int32_t device_type, int32_t device_id);
rp_run_config_set_output_device(config, device_type, device_id) =
    ccall((:rp_run_config_set_output_device, libroundpipe()), rp_status,
          (Ptr{rp_run_config}, Int32, Int32),
          config, device_type, device_id)

# rp_status rp_run_config_set_input_split_dim(rp_run_config *config, int32_t input_index, int32_t dim);
rp_run_config_set_input_split_dim(config, input_index, dim) =
    ccall((:rp_run_config_set_input_split_dim, libroundpipe()), rp_status,
          (Ptr{rp_run_config}, Int32, Int32),
          config, input_index, dim)

# rp_status rp_run_config_set_label_split_dim(rp_run_config *config, int32_t dim);
rp_run_config_set_label_split_dim(config, dim) =
    ccall((:rp_run_config_set_label_split_dim, libroundpipe()), rp_status,
          (Ptr{rp_run_config}, Int32),
          config, dim)

# rp_status rp_run_config_set_split_callback(rp_run_config *config, rp_split_fn fn, void *user_data);
rp_run_config_set_split_callback(config, fn, user_data) =
    ccall((:rp_run_config_set_split_callback, libroundpipe()), rp_status,
          (Ptr{rp_run_config}, rp_split_fn, Ptr{Cvoid}),
          config, fn, user_data)

# rp_status rp_run_config_set_merge_output(rp_run_config *config, int32_t merge);
rp_run_config_set_merge_output(config, merge) =
    ccall((:rp_run_config_set_merge_output, libroundpipe()), rp_status,
          (Ptr{rp_run_config}, Int32),
          config, merge)

# rp_status rp_run_config_get_num_microbatch(int32_t *out_num_microbatch, const rp_run_config *config);
rp_run_config_get_num_microbatch(out_num_microbatch, config) =
    ccall((:rp_run_config_get_num_microbatch, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_run_config}),
          out_num_microbatch, config)

# rp_status rp_run_config_get_recompute_grain(int32_t *out_grain, const rp_run_config *config);
rp_run_config_get_recompute_grain(out_grain, config) =
    ccall((:rp_run_config_get_recompute_grain, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_run_config}),
          out_grain, config)

# rp_status rp_run_config_get_output_device(int32_t *out_device_type, int32_t *out_device_id, const rp_run_config *config);
rp_run_config_get_output_device(out_device_type, out_device_id, config) =
    ccall((:rp_run_config_get_output_device, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{Int32}, Ptr{rp_run_config}),
          out_device_type, out_device_id, config)

# rp_status rp_run_config_get_merge_output(int32_t *out_merge, const rp_run_config *config);
rp_run_config_get_merge_output(out_merge, config) =
    ccall((:rp_run_config_get_merge_output, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_run_config}),
          out_merge, config)

# rp_status rp_model_options_create(rp_model_options **out_options);
rp_model_options_create(out_options) =
    ccall((:rp_model_options_create, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_model_options}},),
          out_options)

# void rp_model_options_destroy(rp_model_options *options);
rp_model_options_destroy(options) =
    ccall((:rp_model_options_destroy, libroundpipe()), Cvoid,
          (Ptr{rp_model_options},),
          options)

# rp_status rp_model_options_set_model_dtype(rp_model_options *options, int32_t dtype);
rp_model_options_set_model_dtype(options, dtype) =
    ccall((:rp_model_options_set_model_dtype, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32),
          options, dtype)

# rp_status rp_model_options_set_optim_dtype(rp_model_options *options, int32_t dtype);
rp_model_options_set_optim_dtype(options, dtype) =
    ccall((:rp_model_options_set_optim_dtype, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32),
          options, dtype)

# rp_status rp_model_options_set_pin_mode(rp_model_options *options, int32_t pin_mode);
rp_model_options_set_pin_mode(options, pin_mode) =
    ccall((:rp_model_options_set_pin_mode, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32),
          options, pin_mode)

# rp_status rp_model_options_set_host_memory_mode(rp_model_options *options, int32_t mode);
rp_model_options_set_host_memory_mode(options, mode) =
    ccall((:rp_model_options_set_host_memory_mode, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32),
          options, mode)

# rp_status rp_model_options_set_run_config(rp_model_options *options, const rp_run_config *config);
rp_model_options_set_run_config(options, config) =
    ccall((:rp_model_options_set_run_config, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Ptr{rp_run_config}),
          options, config)

# rp_status rp_model_options_set_grad_scaler(rp_model_options *options, double initial_scale, int32_t growth_interval);
rp_model_options_set_grad_scaler(options, initial_scale, growth_interval) =
    ccall((:rp_model_options_set_grad_scaler, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Cdouble, Int32),
          options, initial_scale, growth_interval)

# rp_status rp_model_options_set_gpu_memory_cap(rp_model_options *options, int64_t bytes);
rp_model_options_set_gpu_memory_cap(options, bytes) =
    ccall((:rp_model_options_set_gpu_memory_cap, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int64),
          options, bytes)

# rp_status rp_model_options_set_seed(rp_model_options *options, uint64_t seed);
rp_model_options_set_seed(options, seed) =
    ccall((:rp_model_options_set_seed, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, UInt64),
          options, seed)

# rp_status rp_model_options_set_skip_nonfinite_steps(rp_model_options *options, int32_t skip);
rp_model_options_set_skip_nonfinite_steps(options, skip) =
    ccall((:rp_model_options_set_skip_nonfinite_steps, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32),
          options, skip)

# rp_status rp_model_options_set_name(rp_model_options *options, const char *name);
rp_model_options_set_name(options, name) =
    ccall((:rp_model_options_set_name, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Cstring),
          options, name)

# rp_status rp_model_options_set_devices(rp_model_options *options, int32_t kind, int32_t num_devices);
rp_model_options_set_devices(options, kind, num_devices) =
    ccall((:rp_model_options_set_devices, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32, Int32),
          options, kind, num_devices)

# rp_status rp_model_options_set_data_parallel(rp_model_options *options, int32_t rank, int32_t world_size, const char *rendezvous, int64_t timeout_ms);
rp_model_options_set_data_parallel(options, rank, world_size, rendezvous, timeout_ms) =
    ccall((:rp_model_options_set_data_parallel, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32, Int32, Cstring, Int64),
          options, rank, world_size, rendezvous, timeout_ms)

# rp_status rp_model_options_set_global_loss(rp_model_options *options, int32_t global);
rp_model_options_set_global_loss(options, global_) =
    ccall((:rp_model_options_set_global_loss, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32),
          options, global_)

# rp_status rp_model_options_set_lora(rp_model_options *options, int32_t rank, double alpha, double dropout, const char *target_modules);
rp_model_options_set_lora(options, rank, alpha, dropout, target_modules) =
    ccall((:rp_model_options_set_lora, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Int32, Cdouble, Cdouble, Cstring),
          options, rank, alpha, dropout, target_modules)

# rp_status rp_data_parallel_available(int32_t *out_available);
rp_data_parallel_available(out_available) =
    ccall((:rp_data_parallel_available, libroundpipe()), rp_status,
          (Ptr{Int32},),
          out_available)

# rp_status rp_model_options_set_stage_plan(rp_model_options *options, const int32_t *layers_per_stage, size_t n);
rp_model_options_set_stage_plan(options, layers_per_stage, n) =
    ccall((:rp_model_options_set_stage_plan, libroundpipe()), rp_status,
          (Ptr{rp_model_options}, Ptr{Int32}, Csize_t),
          options, layers_per_stage, n)

# rp_status rp_model_create(rp_model **out_model, const char *spec_json, const rp_model_options *options);
rp_model_create(out_model, spec_json, options) =
    ccall((:rp_model_create, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_model}}, Cstring, Ptr{rp_model_options}),
          out_model, spec_json, options)

# rp_status rp_model_create_with_layers(rp_model **out_model, const char *spec_json, const rp_layer_def *const *defs, size_t n_defs, const rp_model_options *options);
rp_model_create_with_layers(out_model, spec_json, defs, n_defs, options) =
    ccall((:rp_model_create_with_layers, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_model}}, Cstring, Ptr{Ptr{rp_layer_def}}, Csize_t, Ptr{rp_model_options}),
          out_model, spec_json, defs, n_defs, options)

# void rp_model_destroy(rp_model *model);
rp_model_destroy(model) = ccall((:rp_model_destroy, libroundpipe()), Cvoid, (Ptr{rp_model},), model)

# rp_status rp_model_num_layers(int32_t *out_count, const rp_model *model);
rp_model_num_layers(out_count, model) =
    ccall((:rp_model_num_layers, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_model}),
          out_count, model)

# rp_status rp_model_num_stages(int32_t *out_count, const rp_model *model);
rp_model_num_stages(out_count, model) =
    ccall((:rp_model_num_stages, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_model}),
          out_count, model)

# rp_status rp_model_num_devices(int32_t *out_count, const rp_model *model);
rp_model_num_devices(out_count, model) =
    ccall((:rp_model_num_devices, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_model}),
          out_count, model)

# rp_status rp_model_stage_plan(int32_t *out_layers_per_stage, int32_t *out_num_stages, int32_t capacity, const rp_model *model);
rp_model_stage_plan(out_layers_per_stage, out_num_stages, capacity, model) =
    ccall((:rp_model_stage_plan, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{Int32}, Int32, Ptr{rp_model}),
          out_layers_per_stage, out_num_stages, capacity, model)

# rp_status rp_model_plan_stages(int32_t *out_layers_per_stage, int32_t *out_num_stages, int32_t capacity, const rp_model *model, int64_t max_stage_bytes, int32_t min_stages);
rp_model_plan_stages(out_layers_per_stage, out_num_stages, capacity, model, max_stage_bytes, min_stages) =
    ccall((:rp_model_plan_stages, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{Int32}, Int32, Ptr{rp_model}, Int64, Int32),
          out_layers_per_stage, out_num_stages, capacity, model, max_stage_bytes, min_stages)

# rp_status rp_model_set_stage_plan(rp_model *model, const int32_t *layers_per_stage, size_t n);
rp_model_set_stage_plan(model, layers_per_stage, n) =
    ccall((:rp_model_set_stage_plan, libroundpipe()), rp_status,
          (Ptr{rp_model}, Ptr{Int32}, Csize_t),
          model, layers_per_stage, n)

# rp_status rp_model_set_backward_stage_plan(rp_model *model, const int32_t *layers_per_stage, size_t n);
rp_model_set_backward_stage_plan(model, layers_per_stage, n) =
    ccall((:rp_model_set_backward_stage_plan, libroundpipe()), rp_status,
          (Ptr{rp_model}, Ptr{Int32}, Csize_t),
          model, layers_per_stage, n)

# rp_status rp_model_backward_stage_plan(int32_t *out_layers_per_stage, int32_t *out_num_stages, int32_t capacity, const rp_model *model);
rp_model_backward_stage_plan(out_layers_per_stage, out_num_stages, capacity, model) =
    ccall((:rp_model_backward_stage_plan, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{Int32}, Int32, Ptr{rp_model}),
          out_layers_per_stage, out_num_stages, capacity, model)

# rp_status rp_model_resolve_run_config(rp_run_config **out_config, const rp_model *model, const rp_run_config *call);
rp_model_resolve_run_config(out_config, model, call) =
    ccall((:rp_model_resolve_run_config, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_run_config}}, Ptr{rp_model}, Ptr{rp_run_config}),
          out_config, model, call)

# rp_status rp_model_step_count(int64_t *out_count, const rp_model *model);
rp_model_step_count(out_count, model) =
    ccall((:rp_model_step_count, libroundpipe()), rp_status,
          (Ptr{Int64}, Ptr{rp_model}),
          out_count, model)

# rp_status rp_model_grad_scale(double *out_scale, int64_t *out_skipped_steps, const rp_model *model);
rp_model_grad_scale(out_scale, out_skipped_steps, model) =
    ccall((:rp_model_grad_scale, libroundpipe()), rp_status,
          (Ptr{Cdouble}, Ptr{Int64}, Ptr{rp_model}),
          out_scale, out_skipped_steps, model)

# rp_status rp_model_nonfinite_counts(int64_t *out_nonfinite_losses, int64_t *out_skipped_steps, const rp_model *model);
rp_model_nonfinite_counts(out_nonfinite_losses, out_skipped_steps, model) =
    ccall((:rp_model_nonfinite_counts, libroundpipe()), rp_status,
          (Ptr{Int64}, Ptr{Int64}, Ptr{rp_model}),
          out_nonfinite_losses, out_skipped_steps, model)

# rp_status rp_model_set_grad_scaler(rp_model *model, double initial_scale, int32_t growth_interval);
rp_model_set_grad_scaler(model, initial_scale, growth_interval) =
    ccall((:rp_model_set_grad_scaler, libroundpipe()), rp_status,
          (Ptr{rp_model}, Cdouble, Int32),
          model, initial_scale, growth_interval)

# rp_status rp_model_set_skip_nonfinite_steps(rp_model *model, int32_t skip);
rp_model_set_skip_nonfinite_steps(model, skip) =
    ccall((:rp_model_set_skip_nonfinite_steps, libroundpipe()), rp_status,
          (Ptr{rp_model}, Int32),
          model, skip)

# rp_status rp_model_gpu_memory_cap(int64_t *out_bytes, const rp_model *model);
rp_model_gpu_memory_cap(out_bytes, model) =
    ccall((:rp_model_gpu_memory_cap, libroundpipe()), rp_status,
          (Ptr{Int64}, Ptr{rp_model}),
          out_bytes, model)

# rp_status rp_model_data_parallel(int32_t *out_rank, int32_t *out_world_size, const rp_model *model);
rp_model_data_parallel(out_rank, out_world_size, model) =
    ccall((:rp_model_data_parallel, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{Int32}, Ptr{rp_model}),
          out_rank, out_world_size, model)

# rp_status rp_model_host_state_bytes(int64_t *out_bytes, int64_t *out_elements, const rp_model *model);
rp_model_host_state_bytes(out_bytes, out_elements, model) =
    ccall((:rp_model_host_state_bytes, libroundpipe()), rp_status,
          (Ptr{Int64}, Ptr{Int64}, Ptr{rp_model}),
          out_bytes, out_elements, model)

# rp_status rp_model_trace_json(const char **out_json, rp_model *model);
rp_model_trace_json(out_json, model) =
    ccall((:rp_model_trace_json, libroundpipe()), rp_status,
          (Ptr{Cstring}, Ptr{rp_model}),
          out_json, model)

# rp_status rp_cuda_memory_stats(int64_t *out_allocated_bytes, int64_t *out_peak_bytes, int32_t device);
rp_cuda_memory_stats(out_allocated_bytes, out_peak_bytes, device) =
    ccall((:rp_cuda_memory_stats, libroundpipe()), rp_status,
          (Ptr{Int64}, Ptr{Int64}, Int32),
          out_allocated_bytes, out_peak_bytes, device)

# rp_status rp_cuda_reset_peak_memory(int32_t device);
rp_cuda_reset_peak_memory(device) =
    ccall((:rp_cuda_reset_peak_memory, libroundpipe()), rp_status,
          (Int32,),
          device)

# rp_status rp_tensor_list_size(size_t *out_size, const rp_tensor_list *list);
rp_tensor_list_size(out_size, list) =
    ccall((:rp_tensor_list_size, libroundpipe()), rp_status,
          (Ptr{Csize_t}, Ptr{rp_tensor_list}),
          out_size, list)

# rp_status rp_tensor_list_get(DLManagedTensor **out_tensor, const rp_tensor_list *list, size_t index);
rp_tensor_list_get(out_tensor, list, index) =
    ccall((:rp_tensor_list_get, libroundpipe()), rp_status,
          (Ptr{Ptr{DLManagedTensor}}, Ptr{rp_tensor_list}, Csize_t),
          out_tensor, list, index)

# void rp_tensor_list_destroy(rp_tensor_list *list);
rp_tensor_list_destroy(list) =
    ccall((:rp_tensor_list_destroy, libroundpipe()), Cvoid,
          (Ptr{rp_tensor_list},),
          list)

# rp_status rp_tensor_list_create(rp_tensor_list **out_list);
rp_tensor_list_create(out_list) =
    ccall((:rp_tensor_list_create, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_tensor_list}},),
          out_list)

# rp_status rp_tensor_list_push(rp_tensor_list *list, DLManagedTensor *tensor);
rp_tensor_list_push(list, tensor) =
    ccall((:rp_tensor_list_push, libroundpipe()), rp_status,
          (Ptr{rp_tensor_list}, Ptr{DLManagedTensor}),
          list, tensor)

# rp_status rp_layer_def_create(rp_layer_def **out_def, const char *type_name, rp_layer_forward_fn forward, rp_layer_backward_fn backward, rp_layer_release_fn release, void *user_data);
rp_layer_def_create(out_def, type_name, forward, backward, release, user_data) =
    ccall((:rp_layer_def_create, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_layer_def}}, Cstring, rp_layer_forward_fn, rp_layer_backward_fn,
           rp_layer_release_fn, Ptr{Cvoid}),
          out_def, type_name, forward, backward, release, user_data)

# void rp_layer_def_destroy(rp_layer_def *def);
rp_layer_def_destroy(def) =
    ccall((:rp_layer_def_destroy, libroundpipe()), Cvoid,
          (Ptr{rp_layer_def},),
          def)

# rp_status rp_layer_def_add_param(rp_layer_def *def, const char *name, const DLManagedTensor *initial, int32_t trainable);
rp_layer_def_add_param(def, name, initial, trainable) =
    ccall((:rp_layer_def_add_param, libroundpipe()), rp_status,
          (Ptr{rp_layer_def}, Cstring, Ptr{DLManagedTensor}, Int32),
          def, name, initial, trainable)

# rp_status rp_layer_def_add_tied_param(rp_layer_def *def, const char *name, const char *tied_to);
rp_layer_def_add_tied_param(def, name, tied_to) =
    ccall((:rp_layer_def_add_tied_param, libroundpipe()), rp_status,
          (Ptr{rp_layer_def}, Cstring, Cstring), def, name, tied_to)

# rp_status rp_layer_def_add_buffer(rp_layer_def *def, const char *name, const DLManagedTensor *initial);
rp_layer_def_add_buffer(def, name, initial) =
    ccall((:rp_layer_def_add_buffer, libroundpipe()), rp_status,
          (Ptr{rp_layer_def}, Cstring, Ptr{DLManagedTensor}),
          def, name, initial)

# rp_status rp_layer_def_set_cost(rp_layer_def *def, double cost);
rp_layer_def_set_cost(def, cost) =
    ccall((:rp_layer_def_set_cost, libroundpipe()), rp_status,
          (Ptr{rp_layer_def}, Cdouble),
          def, cost)

# rp_status rp_layer_def_set_activation_bytes(rp_layer_def *def, double bytes_per_token);
rp_layer_def_set_activation_bytes(def, bytes_per_token) =
    ccall((:rp_layer_def_set_activation_bytes, libroundpipe()), rp_status,
          (Ptr{rp_layer_def}, Cdouble),
          def, bytes_per_token)

# rp_status rp_layer_call_info(int32_t *out_phase, int32_t *out_device_type, int32_t *out_device_id, void **out_stream, uint64_t *out_seed, int32_t *out_microbatch, int32_t *out_training, const rp_layer_call *call);
rp_layer_call_info(out_phase, out_device_type, out_device_id, out_stream, out_seed, out_microbatch,
                   out_training, call) =
    ccall((:rp_layer_call_info, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{Int32}, Ptr{Int32}, Ptr{Ptr{Cvoid}}, Ptr{UInt64}, Ptr{Int32},
           Ptr{Int32}, Ptr{rp_layer_call}),
          out_phase, out_device_type, out_device_id, out_stream, out_seed, out_microbatch,
          out_training, call)

# rp_status rp_layer_call_tensors(const DLManagedTensor *const **out_params, size_t *out_n_params, const DLManagedTensor *const **out_buffers, size_t *out_n_buffers, const rp_layer_call *call);
rp_layer_call_tensors(out_params, out_n_params, out_buffers, out_n_buffers, call) =
    ccall((:rp_layer_call_tensors, libroundpipe()), rp_status,
          (Ptr{Ptr{Ptr{DLManagedTensor}}}, Ptr{Csize_t}, Ptr{Ptr{Ptr{DLManagedTensor}}},
           Ptr{Csize_t}, Ptr{rp_layer_call}),
          out_params, out_n_params, out_buffers, out_n_buffers, call)

# rp_status rp_split_microbatches(rp_tensor_list **out_pieces, const DLManagedTensor *tensor, int32_t dim, int32_t num_microbatch);
rp_split_microbatches(out_pieces, tensor, dim, num_microbatch) =
    ccall((:rp_split_microbatches, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_tensor_list}}, Ptr{DLManagedTensor}, Int32, Int32),
          out_pieces, tensor, dim, num_microbatch)

# rp_status rp_loss_create(rp_loss **out_loss, int32_t kind);
rp_loss_create(out_loss, kind) =
    ccall((:rp_loss_create, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_loss}}, Int32),
          out_loss, kind)

# rp_status rp_loss_create_callback(rp_loss **out_loss, rp_loss_fn fn, void *user_data);
rp_loss_create_callback(out_loss, fn, user_data) =
    ccall((:rp_loss_create_callback, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_loss}}, rp_loss_fn, Ptr{Cvoid}),
          out_loss, fn, user_data)

# rp_status rp_loss_create_device_callback(rp_loss **out_loss, rp_device_loss_fn fn, void *user_data);
rp_loss_create_device_callback(out_loss, fn, user_data) =
    ccall((:rp_loss_create_device_callback, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_loss}}, rp_device_loss_fn, Ptr{Cvoid}),
          out_loss, fn, user_data)

# rp_status rp_loss_set_scale(rp_loss *loss, double scale);
rp_loss_set_scale(loss, scale) =
    ccall((:rp_loss_set_scale, libroundpipe()), rp_status,
          (Ptr{rp_loss}, Cdouble),
          loss, scale)

# void rp_loss_destroy(rp_loss *loss);
rp_loss_destroy(loss) = ccall((:rp_loss_destroy, libroundpipe()), Cvoid, (Ptr{rp_loss},), loss)

# rp_status rp_forward(rp_tensor_list **out_outputs, rp_model *model, const DLManagedTensor *const *inputs, size_t n_inputs, const rp_run_config *config);
rp_forward(out_outputs, model, inputs, n_inputs, config) =
    ccall((:rp_forward, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_tensor_list}}, Ptr{rp_model}, Ptr{Ptr{DLManagedTensor}}, Csize_t,
           Ptr{rp_run_config}),
          out_outputs, model, inputs, n_inputs, config)

# rp_status rp_forward_train(rp_tensor_list **out_outputs, rp_model *model, const DLManagedTensor *const *inputs, size_t n_inputs, const rp_run_config *config);
rp_forward_train(out_outputs, model, inputs, n_inputs, config) =
    ccall((:rp_forward_train, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_tensor_list}}, Ptr{rp_model}, Ptr{Ptr{DLManagedTensor}}, Csize_t,
           Ptr{rp_run_config}),
          out_outputs, model, inputs, n_inputs, config)

# rp_status rp_backward(rp_model *model, const DLManagedTensor *const *output_grads, size_t n_grads);
rp_backward(model, output_grads, n_grads) =
    ccall((:rp_backward, libroundpipe()), rp_status,
          (Ptr{rp_model}, Ptr{Ptr{DLManagedTensor}}, Csize_t), model, output_grads, n_grads)

# rp_status rp_backward_input_grads(rp_tensor_list **out_input_grads, rp_model *model, const DLManagedTensor *const *output_grads, size_t n_grads);
rp_backward_input_grads(out_input_grads, model, output_grads, n_grads) =
    ccall((:rp_backward_input_grads, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_tensor_list}}, Ptr{rp_model}, Ptr{Ptr{DLManagedTensor}}, Csize_t),
          out_input_grads, model, output_grads, n_grads)

# rp_status rp_forward_backward(double *out_loss, rp_tensor_list **out_outputs, rp_model *model, const DLManagedTensor *const *inputs, size_t n_inputs, const DLManagedTensor *labels, const rp_loss *loss, const rp_run_config *config);
rp_forward_backward(out_loss, out_outputs, model, inputs, n_inputs, labels, loss, config) =
    ccall((:rp_forward_backward, libroundpipe()), rp_status,
          (Ptr{Cdouble}, Ptr{Ptr{rp_tensor_list}}, Ptr{rp_model}, Ptr{Ptr{DLManagedTensor}}, Csize_t,
           Ptr{DLManagedTensor}, Ptr{rp_loss}, Ptr{rp_run_config}),
          out_loss, out_outputs, model, inputs, n_inputs, labels, loss, config)

# rp_status rp_optimizer_create(rp_optimizer **out_optimizer, int32_t kind);
rp_optimizer_create(out_optimizer, kind) =
    ccall((:rp_optimizer_create, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_optimizer}}, Int32),
          out_optimizer, kind)

# void rp_optimizer_destroy(rp_optimizer *optimizer);
rp_optimizer_destroy(optimizer) =
    ccall((:rp_optimizer_destroy, libroundpipe()), Cvoid,
          (Ptr{rp_optimizer},),
          optimizer)

# rp_status rp_optimizer_set_learning_rate(rp_optimizer *optimizer, double lr);
rp_optimizer_set_learning_rate(optimizer, lr) =
    ccall((:rp_optimizer_set_learning_rate, libroundpipe()), rp_status,
          (Ptr{rp_optimizer}, Cdouble),
          optimizer, lr)

# rp_status rp_optimizer_set_betas(rp_optimizer *optimizer, double beta1, double beta2);
rp_optimizer_set_betas(optimizer, beta1, beta2) =
    ccall((:rp_optimizer_set_betas, libroundpipe()), rp_status,
          (Ptr{rp_optimizer}, Cdouble, Cdouble),
          optimizer, beta1, beta2)

# rp_status rp_optimizer_set_eps(rp_optimizer *optimizer, double eps);
rp_optimizer_set_eps(optimizer, eps) =
    ccall((:rp_optimizer_set_eps, libroundpipe()), rp_status,
          (Ptr{rp_optimizer}, Cdouble),
          optimizer, eps)

# rp_status rp_optimizer_set_weight_decay(rp_optimizer *optimizer, double weight_decay);
rp_optimizer_set_weight_decay(optimizer, weight_decay) =
    ccall((:rp_optimizer_set_weight_decay, libroundpipe()), rp_status,
          (Ptr{rp_optimizer}, Cdouble),
          optimizer, weight_decay)

# rp_status rp_optimizer_set_momentum(rp_optimizer *optimizer, double momentum);
rp_optimizer_set_momentum(optimizer, momentum) =
    ccall((:rp_optimizer_set_momentum, libroundpipe()), rp_status,
          (Ptr{rp_optimizer}, Cdouble),
          optimizer, momentum)

# rp_status rp_adam_apply(DLManagedTensor *const *params, const DLManagedTensor *const *grads, DLManagedTensor *const *exp_avgs, DLManagedTensor *const *exp_avg_sqs, const int64_t *steps, size_t n_tensors, double lr, double beta1, double beta2, double eps, double weight_decay, int32_t decoupled_weight_decay);
rp_adam_apply(params, grads, exp_avgs, exp_avg_sqs, steps, n_tensors, lr, beta1, beta2, eps,
              weight_decay, decoupled_weight_decay) =
    ccall((:rp_adam_apply, libroundpipe()), rp_status,
          (Ptr{Ptr{DLManagedTensor}}, Ptr{Ptr{DLManagedTensor}}, Ptr{Ptr{DLManagedTensor}},
           Ptr{Ptr{DLManagedTensor}}, Ptr{Int64}, Csize_t, Cdouble, Cdouble, Cdouble, Cdouble,
           Cdouble, Int32),
          params, grads, exp_avgs, exp_avg_sqs, steps, n_tensors, lr, beta1, beta2, eps,
          weight_decay, decoupled_weight_decay)

# rp_status rp_step(rp_model *model, const rp_optimizer *optimizer, int32_t is_async);
rp_step(model, optimizer, is_async) =
    ccall((:rp_step, libroundpipe()), rp_status,
          (Ptr{rp_model}, Ptr{rp_optimizer}, Int32),
          model, optimizer, is_async)

# rp_status rp_step_callback(rp_model *model, rp_step_fn fn, void *user_data, int32_t is_async);
rp_step_callback(model, fn, user_data, is_async) =
    ccall((:rp_step_callback, libroundpipe()), rp_status,
          (Ptr{rp_model}, rp_step_fn, Ptr{Cvoid}, Int32),
          model, fn, user_data, is_async)

# rp_status rp_model_set_step_in_call(rp_model *model, const rp_optimizer *optimizer);
rp_model_set_step_in_call(model, optimizer) =
    ccall((:rp_model_set_step_in_call, libroundpipe()), rp_status,
          (Ptr{rp_model}, Ptr{rp_optimizer}),
          model, optimizer)

# rp_status rp_model_step_in_call(int32_t *out_enabled, const rp_model *model);
rp_model_step_in_call(out_enabled, model) =
    ccall((:rp_model_step_in_call, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_model}),
          out_enabled, model)

# rp_status rp_synchronize(rp_model *model);
rp_synchronize(model) = ccall((:rp_synchronize, libroundpipe()), rp_status, (Ptr{rp_model},), model)

# rp_status rp_zero_grad(rp_model *model);
rp_zero_grad(model) = ccall((:rp_zero_grad, libroundpipe()), rp_status, (Ptr{rp_model},), model)

# rp_status rp_param_count(size_t *out_count, const rp_model *model);
rp_param_count(out_count, model) =
    ccall((:rp_param_count, libroundpipe()), rp_status,
          (Ptr{Csize_t}, Ptr{rp_model}),
          out_count, model)

# rp_status rp_param_name(const char **out_name, const rp_model *model, size_t index);
rp_param_name(out_name, model, index) =
    ccall((:rp_param_name, libroundpipe()), rp_status,
          (Ptr{Cstring}, Ptr{rp_model}, Csize_t),
          out_name, model, index)

# rp_status rp_param_find(size_t *out_index, const rp_model *model, const char *name);
rp_param_find(out_index, model, name) =
    ccall((:rp_param_find, libroundpipe()), rp_status,
          (Ptr{Csize_t}, Ptr{rp_model}, Cstring),
          out_index, model, name)

# rp_status rp_param_hf_name(const char **out_name, const rp_model *model, size_t index);
rp_param_hf_name(out_name, model, index) =
    ccall((:rp_param_hf_name, libroundpipe()), rp_status,
          (Ptr{Cstring}, Ptr{rp_model}, Csize_t),
          out_name, model, index)

# rp_status rp_param_kind_of(int32_t *out_kind, const rp_model *model, size_t index);
rp_param_kind_of(out_kind, model, index) =
    ccall((:rp_param_kind_of, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_model}, Csize_t),
          out_kind, model, index)

# rp_status rp_param_shape(int64_t *out_shape, int32_t *out_ndim, int32_t capacity, const rp_model *model, size_t index);
rp_param_shape(out_shape, out_ndim, capacity, model, index) =
    ccall((:rp_param_shape, libroundpipe()), rp_status,
          (Ptr{Int64}, Ptr{Int32}, Int32, Ptr{rp_model}, Csize_t),
          out_shape, out_ndim, capacity, model, index)

# rp_status rp_param_master(DLManagedTensor **out_tensor, rp_model *model, size_t index);
rp_param_master(out_tensor, model, index) =
    ccall((:rp_param_master, libroundpipe()), rp_status,
          (Ptr{Ptr{DLManagedTensor}}, Ptr{rp_model}, Csize_t),
          out_tensor, model, index)

# rp_status rp_param_grad(DLManagedTensor **out_tensor, rp_model *model, size_t index);
rp_param_grad(out_tensor, model, index) =
    ccall((:rp_param_grad, libroundpipe()), rp_status,
          (Ptr{Ptr{DLManagedTensor}}, Ptr{rp_model}, Csize_t),
          out_tensor, model, index)

# rp_status rp_param_grad_received(int32_t *out_received, const rp_model *model, size_t index);
rp_param_grad_received(out_received, model, index) =
    ccall((:rp_param_grad_received, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{rp_model}, Csize_t),
          out_received, model, index)

# rp_status rp_model_save(rp_model *model, const char *path);
rp_model_save(model, path) =
    ccall((:rp_model_save, libroundpipe()), rp_status,
          (Ptr{rp_model}, Cstring),
          model, path)

# rp_status rp_model_load(rp_model *model, const char *path);
rp_model_load(model, path) =
    ccall((:rp_model_load, libroundpipe()), rp_status,
          (Ptr{rp_model}, Cstring),
          model, path)

# rp_status rp_model_create_from_hf(rp_model **out_model, const char *dir, const rp_model_options *options);
rp_model_create_from_hf(out_model, dir, options) =
    ccall((:rp_model_create_from_hf, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_model}}, Cstring, Ptr{rp_model_options}),
          out_model, dir, options)

# rp_status rp_model_create_from_hf_config(rp_model **out_model, const char *config_json, const rp_model_options *options);
rp_model_create_from_hf_config(out_model, config_json, options) =
    ccall((:rp_model_create_from_hf_config, libroundpipe()), rp_status,
          (Ptr{Ptr{rp_model}}, Cstring, Ptr{rp_model_options}),
          out_model, config_json, options)

# rp_status rp_model_load_hf(rp_model *model, const char *dir);
rp_model_load_hf(model, dir) =
    ccall((:rp_model_load_hf, libroundpipe()), rp_status,
          (Ptr{rp_model}, Cstring),
          model, dir)

# rp_status rp_model_save_hf(rp_model *model, const char *dir);
rp_model_save_hf(model, dir) =
    ccall((:rp_model_save_hf, libroundpipe()), rp_status,
          (Ptr{rp_model}, Cstring),
          model, dir)

# rp_status rp_model_lora(int32_t *out_rank, double *out_alpha, double *out_dropout, const char **out_target_modules, const rp_model *model);
rp_model_lora(out_rank, out_alpha, out_dropout, out_target_modules, model) =
    ccall((:rp_model_lora, libroundpipe()), rp_status,
          (Ptr{Int32}, Ptr{Cdouble}, Ptr{Cdouble}, Ptr{Cstring}, Ptr{rp_model}),
          out_rank, out_alpha, out_dropout, out_target_modules, model)

# rp_status rp_model_save_lora(rp_model *model, const char *dir, const char *base_model);
rp_model_save_lora(model, dir, base_model) =
    ccall((:rp_model_save_lora, libroundpipe()), rp_status,
          (Ptr{rp_model}, Cstring, Cstring),
          model, dir, base_model)

# rp_status rp_model_load_lora(rp_model *model, const char *dir);
rp_model_load_lora(model, dir) =
    ccall((:rp_model_load_lora, libroundpipe()), rp_status,
          (Ptr{rp_model}, Cstring),
          model, dir)

end # module LibRoundPipe
