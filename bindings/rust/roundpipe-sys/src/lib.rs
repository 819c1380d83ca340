//! Raw FFI declarations of RoundPipe's C API, `include/roundpipe.h`, one for one.
//!
//! Everything here is `unsafe` and mirrors the header exactly: the same names, the same
//! parameter order, enums as `c_int` constants (a C enum may carry values a Rust `enum` could
//! not hold). Read the header for what each call does; the safe API is the `roundpipe` crate.
//!
//! `tools/abi/check_bindings.py` compares this file with the header (through `swig -xml`) on
//! every test run: every function, callback type, struct layout and constant must match.

#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use std::os::raw::{c_char, c_double, c_int, c_void};

// -------------------------------------------------------------------------------------------
// DLPack 1.x
// -------------------------------------------------------------------------------------------

pub const DLPACK_MAJOR_VERSION: c_int = 1;
pub const DLPACK_MINOR_VERSION: c_int = 0;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

/// `DLDeviceType` (a C enum).
pub type DLDeviceType = c_int;
pub const kDLCPU: DLDeviceType = 1;
pub const kDLCUDA: DLDeviceType = 2;
pub const kDLCUDAHost: DLDeviceType = 3;
pub const kDLOpenCL: DLDeviceType = 4;
pub const kDLVulkan: DLDeviceType = 7;
pub const kDLMetal: DLDeviceType = 8;
pub const kDLVPI: DLDeviceType = 9;
pub const kDLROCM: DLDeviceType = 10;
pub const kDLROCMHost: DLDeviceType = 11;
pub const kDLExtDev: DLDeviceType = 12;
pub const kDLCUDAManaged: DLDeviceType = 13;
pub const kDLOneAPI: DLDeviceType = 14;
pub const kDLWebGPU: DLDeviceType = 15;
pub const kDLHexagon: DLDeviceType = 16;
pub const kDLMAIA: DLDeviceType = 17;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDevice {
    pub device_type: DLDeviceType,
    pub device_id: i32,
}

/// `DLDataTypeCode` (a C enum).
pub type DLDataTypeCode = c_int;
pub const kDLInt: DLDataTypeCode = 0;
pub const kDLUInt: DLDataTypeCode = 1;
pub const kDLFloat: DLDataTypeCode = 2;
pub const kDLOpaqueHandle: DLDataTypeCode = 3;
pub const kDLBfloat: DLDataTypeCode = 4;
pub const kDLComplex: DLDataTypeCode = 5;
pub const kDLBool: DLDataTypeCode = 6;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(self_: *mut DLManagedTensor)>,
}

#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(self_: *mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

// -------------------------------------------------------------------------------------------
// Status, errors, versions, logging
// -------------------------------------------------------------------------------------------

/// `rp_status` (a C enum): 0 is success, errors are negative.
pub type rp_status = c_int;
pub const RP_OK: rp_status = 0;
pub const RP_ERR_INVALID_ARGUMENT: rp_status = -1;
pub const RP_ERR_OUT_OF_MEMORY: rp_status = -2;
pub const RP_ERR_IO: rp_status = -3;
pub const RP_ERR_CUDA: rp_status = -4;
pub const RP_ERR_CALLBACK: rp_status = -5;
pub const RP_ERR_STATE: rp_status = -6;
pub const RP_ERR_INTERNAL: rp_status = -7;

/// `rp_log_level` (a C enum).
pub type rp_log_level = c_int;
pub const RP_LOG_DEBUG: rp_log_level = 0;
pub const RP_LOG_INFO: rp_log_level = 1;
pub const RP_LOG_WARN: rp_log_level = 2;
pub const RP_LOG_ERROR: rp_log_level = 3;

pub type rp_log_fn =
    Option<unsafe extern "C" fn(level: i32, message: *const c_char, user_data: *mut c_void)>;

pub type rp_progress_fn = Option<
    unsafe extern "C" fn(what: *const c_char, done: i64, total: i64, user_data: *mut c_void),
>;

// -------------------------------------------------------------------------------------------
// Enumerations used by options
// -------------------------------------------------------------------------------------------

pub type rp_dtype = c_int;
pub const RP_DTYPE_DEFAULT: rp_dtype = 0;
pub const RP_DTYPE_F32: rp_dtype = 1;
pub const RP_DTYPE_BF16: rp_dtype = 2;
pub const RP_DTYPE_F16: rp_dtype = 3;

pub type rp_pin_mode = c_int;
pub const RP_PIN_ALLOC: rp_pin_mode = 0;
pub const RP_PIN_REGISTER: rp_pin_mode = 1;
pub const RP_PIN_OFF: rp_pin_mode = 2;

pub type rp_host_memory_mode = c_int;
pub const RP_HOST_MEMORY_STANDARD: rp_host_memory_mode = 0;
pub const RP_HOST_MEMORY_SAVING: rp_host_memory_mode = 1;

pub type rp_device_kind = c_int;
pub const RP_DEVICE_AUTO: rp_device_kind = 0;
pub const RP_DEVICE_CPU: rp_device_kind = 1;
pub const RP_DEVICE_CUDA: rp_device_kind = 2;

pub type rp_recompute_grain = c_int;
pub const RP_GRAIN_DEFAULT: rp_recompute_grain = 0;
pub const RP_GRAIN_STAGE: rp_recompute_grain = 1;
pub const RP_GRAIN_LAYER: rp_recompute_grain = 2;

/// Value for `rp_run_config_set_input_split_dim`: give every microbatch the whole tensor.
pub const RP_SPLIT_REPLICATE: i32 = -1;

pub type rp_loss_kind = c_int;
pub const RP_LOSS_OUTPUT: rp_loss_kind = 0;
pub const RP_LOSS_MSE: rp_loss_kind = 1;
pub const RP_LOSS_CROSS_ENTROPY: rp_loss_kind = 2;
pub const RP_LOSS_CAUSAL_LM: rp_loss_kind = 3;

pub type rp_optimizer_kind = c_int;
pub const RP_OPTIMIZER_ADAMW: rp_optimizer_kind = 0;
pub const RP_OPTIMIZER_SGD: rp_optimizer_kind = 1;

pub type rp_layer_phase = c_int;
pub const RP_PHASE_FORWARD: rp_layer_phase = 0;
pub const RP_PHASE_RECOMPUTE: rp_layer_phase = 1;
pub const RP_PHASE_TAIL: rp_layer_phase = 2;

pub type rp_param_kind = c_int;
pub const RP_PARAM_TRAINABLE: rp_param_kind = 0;
pub const RP_PARAM_FROZEN: rp_param_kind = 1;
pub const RP_PARAM_BUFFER: rp_param_kind = 2;

/// ABI version this crate was written for; compare with `rp_abi_version()` before use.
pub const RP_ABI_VERSION: i32 = 1;

// -------------------------------------------------------------------------------------------
// Opaque handles (never constructed in Rust; only pointers to them exist)
// -------------------------------------------------------------------------------------------

#[repr(C)]
pub struct rp_run_config {
    _private: [u8; 0],
}
#[repr(C)]
pub struct rp_model_options {
    _private: [u8; 0],
}
#[repr(C)]
pub struct rp_model {
    _private: [u8; 0],
}
#[repr(C)]
pub struct rp_tensor_list {
    _private: [u8; 0],
}
#[repr(C)]
pub struct rp_loss {
    _private: [u8; 0],
}
#[repr(C)]
pub struct rp_optimizer {
    _private: [u8; 0],
}
#[repr(C)]
pub struct rp_layer_def {
    _private: [u8; 0],
}
#[repr(C)]
pub struct rp_layer_call {
    _private: [u8; 0],
}

// -------------------------------------------------------------------------------------------
// Callback types
// -------------------------------------------------------------------------------------------

pub type rp_split_fn = Option<
    unsafe extern "C" fn(
        out_pieces: *mut *mut DLManagedTensor,
        inputs: *const *const DLManagedTensor,
        n_inputs: usize,
        num_microbatch: i32,
        user_data: *mut c_void,
    ) -> i32,
>;

pub type rp_loss_fn = Option<
    unsafe extern "C" fn(
        out_loss: *mut c_double,
        out_grad: *mut *mut DLManagedTensor,
        outputs: *const DLManagedTensor,
        labels: *const DLManagedTensor,
        microbatch: i32,
        user_data: *mut c_void,
    ) -> i32,
>;

pub type rp_layer_forward_fn = Option<
    unsafe extern "C" fn(
        out_outputs: *mut rp_tensor_list,
        inout_context: *mut *mut c_void,
        call: *const rp_layer_call,
        inputs: *const *const DLManagedTensor,
        n_inputs: usize,
        user_data: *mut c_void,
    ) -> i32,
>;

pub type rp_layer_backward_fn = Option<
    unsafe extern "C" fn(
        out_input_grads: *mut rp_tensor_list,
        out_param_grads: *mut rp_tensor_list,
        context: *mut c_void,
        call: *const rp_layer_call,
        output_grads: *const *const DLManagedTensor,
        n_outputs: usize,
        user_data: *mut c_void,
    ) -> i32,
>;

pub type rp_layer_release_fn =
    Option<unsafe extern "C" fn(context: *mut c_void, user_data: *mut c_void)>;

pub type rp_device_loss_fn = Option<
    unsafe extern "C" fn(
        out_loss: *mut *mut DLManagedTensor,
        out_grads: *mut rp_tensor_list,
        call: *const rp_layer_call,
        outputs: *const *const DLManagedTensor,
        n_outputs: usize,
        labels: *const DLManagedTensor,
        user_data: *mut c_void,
    ) -> i32,
>;

pub type rp_step_fn =
    Option<unsafe extern "C" fn(model: *mut rp_model, user_data: *mut c_void) -> i32>;

// -------------------------------------------------------------------------------------------
// Functions
// -------------------------------------------------------------------------------------------

extern "C" {
    // Status, errors, versions, logging
    pub fn rp_version() -> *const c_char;
    pub fn rp_abi_version() -> i32;
    pub fn rp_torch_version() -> *const c_char;
    pub fn rp_status_string(status: rp_status) -> *const c_char;
    pub fn rp_last_error_message() -> *const c_char;
    pub fn rp_set_log_callback(fn_: rp_log_fn, min_level: i32, user_data: *mut c_void)
        -> rp_status;
    pub fn rp_set_progress_callback(fn_: rp_progress_fn, user_data: *mut c_void) -> rp_status;
    pub fn rp_cuda_device_count(out_count: *mut i32) -> rp_status;

    // Run configuration
    pub fn rp_run_config_create(out_config: *mut *mut rp_run_config) -> rp_status;
    pub fn rp_run_config_destroy(config: *mut rp_run_config);
    pub fn rp_run_config_set_num_microbatch(
        config: *mut rp_run_config,
        num_microbatch: i32,
    ) -> rp_status;
    pub fn rp_run_config_set_recompute_grain(config: *mut rp_run_config, grain: i32) -> rp_status;
    pub fn rp_run_config_set_output_device(
        config: *mut rp_run_config,
        device_type: i32,
        device_id: i32,
    ) -> rp_status;
    pub fn rp_run_config_set_input_split_dim(
        config: *mut rp_run_config,
        input_index: i32,
        dim: i32,
    ) -> rp_status;
    pub fn rp_run_config_set_label_split_dim(config: *mut rp_run_config, dim: i32) -> rp_status;
    pub fn rp_run_config_set_split_callback(
        config: *mut rp_run_config,
        fn_: rp_split_fn,
        user_data: *mut c_void,
    ) -> rp_status;
    pub fn rp_run_config_set_merge_output(config: *mut rp_run_config, merge: i32) -> rp_status;
    pub fn rp_run_config_get_num_microbatch(
        out_num_microbatch: *mut i32,
        config: *const rp_run_config,
    ) -> rp_status;
    pub fn rp_run_config_get_recompute_grain(
        out_grain: *mut i32,
        config: *const rp_run_config,
    ) -> rp_status;
    pub fn rp_run_config_get_output_device(
        out_device_type: *mut i32,
        out_device_id: *mut i32,
        config: *const rp_run_config,
    ) -> rp_status;
    pub fn rp_run_config_get_merge_output(
        out_merge: *mut i32,
        config: *const rp_run_config,
    ) -> rp_status;

    // Model options and model lifetime
    pub fn rp_model_options_create(out_options: *mut *mut rp_model_options) -> rp_status;
    pub fn rp_model_options_destroy(options: *mut rp_model_options);
    pub fn rp_model_options_set_model_dtype(
        options: *mut rp_model_options,
        dtype: i32,
    ) -> rp_status;
    pub fn rp_model_options_set_optim_dtype(
        options: *mut rp_model_options,
        dtype: i32,
    ) -> rp_status;
    pub fn rp_model_options_set_pin_mode(
        options: *mut rp_model_options,
        pin_mode: i32,
    ) -> rp_status;
    pub fn rp_model_options_set_host_memory_mode(
        options: *mut rp_model_options,
        mode: i32,
    ) -> rp_status;
    pub fn rp_model_options_set_run_config(
        options: *mut rp_model_options,
        config: *const rp_run_config,
    ) -> rp_status;
    pub fn rp_model_options_set_grad_scaler(
        options: *mut rp_model_options,
        initial_scale: c_double,
        growth_interval: i32,
    ) -> rp_status;
    pub fn rp_model_options_set_gpu_memory_cap(
        options: *mut rp_model_options,
        bytes: i64,
    ) -> rp_status;
    pub fn rp_model_options_set_seed(options: *mut rp_model_options, seed: u64) -> rp_status;
    pub fn rp_model_options_set_skip_nonfinite_steps(
        options: *mut rp_model_options,
        skip: i32,
    ) -> rp_status;
    pub fn rp_model_options_set_name(
        options: *mut rp_model_options,
        name: *const c_char,
    ) -> rp_status;
    pub fn rp_model_options_set_devices(
        options: *mut rp_model_options,
        kind: i32,
        num_devices: i32,
    ) -> rp_status;
    pub fn rp_model_options_set_data_parallel(
        options: *mut rp_model_options,
        rank: i32,
        world_size: i32,
        rendezvous: *const c_char,
        timeout_ms: i64,
    ) -> rp_status;
    pub fn rp_model_options_set_global_loss(
        options: *mut rp_model_options,
        global: i32,
    ) -> rp_status;
    pub fn rp_data_parallel_available(out_available: *mut i32) -> rp_status;
    pub fn rp_model_options_set_lora(
        options: *mut rp_model_options,
        rank: i32,
        alpha: f64,
        dropout: f64,
        target_modules: *const c_char,
    ) -> rp_status;
    pub fn rp_model_options_set_stage_plan(
        options: *mut rp_model_options,
        layers_per_stage: *const i32,
        n: usize,
    ) -> rp_status;
    pub fn rp_model_create(
        out_model: *mut *mut rp_model,
        spec_json: *const c_char,
        options: *const rp_model_options,
    ) -> rp_status;
    pub fn rp_model_create_with_layers(
        out_model: *mut *mut rp_model,
        spec_json: *const c_char,
        defs: *const *const rp_layer_def,
        n_defs: usize,
        options: *const rp_model_options,
    ) -> rp_status;
    pub fn rp_model_destroy(model: *mut rp_model);
    pub fn rp_model_num_layers(out_count: *mut i32, model: *const rp_model) -> rp_status;
    pub fn rp_model_num_stages(out_count: *mut i32, model: *const rp_model) -> rp_status;
    pub fn rp_model_num_devices(out_count: *mut i32, model: *const rp_model) -> rp_status;
    pub fn rp_model_stage_plan(
        out_layers_per_stage: *mut i32,
        out_num_stages: *mut i32,
        capacity: i32,
        model: *const rp_model,
    ) -> rp_status;
    pub fn rp_model_plan_stages(
        out_layers_per_stage: *mut i32,
        out_num_stages: *mut i32,
        capacity: i32,
        model: *const rp_model,
        max_stage_bytes: i64,
        min_stages: i32,
    ) -> rp_status;
    pub fn rp_model_set_stage_plan(
        model: *mut rp_model,
        layers_per_stage: *const i32,
        n: usize,
    ) -> rp_status;
    pub fn rp_model_set_backward_stage_plan(
        model: *mut rp_model,
        layers_per_stage: *const i32,
        n: usize,
    ) -> rp_status;
    pub fn rp_model_backward_stage_plan(
        out_layers_per_stage: *mut i32,
        out_num_stages: *mut i32,
        capacity: i32,
        model: *const rp_model,
    ) -> rp_status;
    pub fn rp_model_resolve_run_config(
        out_config: *mut *mut rp_run_config,
        model: *const rp_model,
        call: *const rp_run_config,
    ) -> rp_status;
    pub fn rp_model_step_count(out_count: *mut i64, model: *const rp_model) -> rp_status;
    pub fn rp_model_grad_scale(
        out_scale: *mut c_double,
        out_skipped_steps: *mut i64,
        model: *const rp_model,
    ) -> rp_status;
    pub fn rp_model_set_grad_scaler(
        model: *mut rp_model,
        initial_scale: c_double,
        growth_interval: i32,
    ) -> rp_status;
    pub fn rp_model_set_skip_nonfinite_steps(model: *mut rp_model, skip: i32) -> rp_status;
    pub fn rp_model_nonfinite_counts(
        out_nonfinite_losses: *mut i64,
        out_skipped_steps: *mut i64,
        model: *const rp_model,
    ) -> rp_status;
    pub fn rp_model_gpu_memory_cap(out_bytes: *mut i64, model: *const rp_model) -> rp_status;
    pub fn rp_model_data_parallel(
        out_rank: *mut i32,
        out_world_size: *mut i32,
        model: *const rp_model,
    ) -> rp_status;
    pub fn rp_model_host_state_bytes(
        out_bytes: *mut i64,
        out_elements: *mut i64,
        model: *const rp_model,
    ) -> rp_status;
    pub fn rp_model_trace_json(out_json: *mut *const c_char, model: *mut rp_model) -> rp_status;
    pub fn rp_cuda_memory_stats(
        out_allocated_bytes: *mut i64,
        out_peak_bytes: *mut i64,
        device: i32,
    ) -> rp_status;
    pub fn rp_cuda_reset_peak_memory(device: i32) -> rp_status;

    // Tensor lists
    pub fn rp_tensor_list_size(out_size: *mut usize, list: *const rp_tensor_list) -> rp_status;
    pub fn rp_tensor_list_get(
        out_tensor: *mut *mut DLManagedTensor,
        list: *const rp_tensor_list,
        index: usize,
    ) -> rp_status;
    pub fn rp_tensor_list_destroy(list: *mut rp_tensor_list);
    pub fn rp_tensor_list_create(out_list: *mut *mut rp_tensor_list) -> rp_status;
    pub fn rp_tensor_list_push(
        list: *mut rp_tensor_list,
        tensor: *mut DLManagedTensor,
    ) -> rp_status;

    // Caller-defined layers
    pub fn rp_layer_def_create(
        out_def: *mut *mut rp_layer_def,
        type_name: *const c_char,
        forward: rp_layer_forward_fn,
        backward: rp_layer_backward_fn,
        release: rp_layer_release_fn,
        user_data: *mut c_void,
    ) -> rp_status;
    pub fn rp_layer_def_destroy(def: *mut rp_layer_def);
    pub fn rp_layer_def_add_param(
        def: *mut rp_layer_def,
        name: *const c_char,
        initial: *const DLManagedTensor,
        trainable: i32,
    ) -> rp_status;
    pub fn rp_layer_def_add_tied_param(
        def: *mut rp_layer_def,
        name: *const c_char,
        tied_to: *const c_char,
    ) -> rp_status;
    pub fn rp_layer_def_add_buffer(
        def: *mut rp_layer_def,
        name: *const c_char,
        initial: *const DLManagedTensor,
    ) -> rp_status;
    pub fn rp_layer_def_set_cost(def: *mut rp_layer_def, cost: c_double) -> rp_status;
    pub fn rp_layer_def_set_activation_bytes(
        def: *mut rp_layer_def,
        bytes_per_token: c_double,
    ) -> rp_status;
    pub fn rp_layer_call_info(
        out_phase: *mut i32,
        out_device_type: *mut i32,
        out_device_id: *mut i32,
        out_stream: *mut *mut c_void,
        out_seed: *mut u64,
        out_microbatch: *mut i32,
        out_training: *mut i32,
        call: *const rp_layer_call,
    ) -> rp_status;
    pub fn rp_layer_call_tensors(
        out_params: *mut *const *const DLManagedTensor,
        out_n_params: *mut usize,
        out_buffers: *mut *const *const DLManagedTensor,
        out_n_buffers: *mut usize,
        call: *const rp_layer_call,
    ) -> rp_status;
    pub fn rp_split_microbatches(
        out_pieces: *mut *mut rp_tensor_list,
        tensor: *const DLManagedTensor,
        dim: i32,
        num_microbatch: i32,
    ) -> rp_status;

    // Losses
    pub fn rp_loss_create(out_loss: *mut *mut rp_loss, kind: i32) -> rp_status;
    pub fn rp_loss_create_callback(
        out_loss: *mut *mut rp_loss,
        fn_: rp_loss_fn,
        user_data: *mut c_void,
    ) -> rp_status;
    pub fn rp_loss_create_device_callback(
        out_loss: *mut *mut rp_loss,
        fn_: rp_device_loss_fn,
        user_data: *mut c_void,
    ) -> rp_status;
    pub fn rp_loss_set_scale(loss: *mut rp_loss, scale: c_double) -> rp_status;
    pub fn rp_loss_destroy(loss: *mut rp_loss);

    // Forward and fused forward + backward
    pub fn rp_forward(
        out_outputs: *mut *mut rp_tensor_list,
        model: *mut rp_model,
        inputs: *const *const DLManagedTensor,
        n_inputs: usize,
        config: *const rp_run_config,
    ) -> rp_status;
    pub fn rp_forward_train(
        out_outputs: *mut *mut rp_tensor_list,
        model: *mut rp_model,
        inputs: *const *const DLManagedTensor,
        n_inputs: usize,
        config: *const rp_run_config,
    ) -> rp_status;
    pub fn rp_backward(
        model: *mut rp_model,
        output_grads: *const *const DLManagedTensor,
        n_grads: usize,
    ) -> rp_status;
    pub fn rp_backward_input_grads(
        out_input_grads: *mut *mut rp_tensor_list,
        model: *mut rp_model,
        output_grads: *const *const DLManagedTensor,
        n_grads: usize,
    ) -> rp_status;
    pub fn rp_forward_backward(
        out_loss: *mut c_double,
        out_outputs: *mut *mut rp_tensor_list,
        model: *mut rp_model,
        inputs: *const *const DLManagedTensor,
        n_inputs: usize,
        labels: *const DLManagedTensor,
        loss: *const rp_loss,
        config: *const rp_run_config,
    ) -> rp_status;

    // Optimizer
    pub fn rp_optimizer_create(out_optimizer: *mut *mut rp_optimizer, kind: i32) -> rp_status;
    pub fn rp_optimizer_destroy(optimizer: *mut rp_optimizer);
    pub fn rp_optimizer_set_learning_rate(optimizer: *mut rp_optimizer, lr: c_double) -> rp_status;
    pub fn rp_optimizer_set_betas(
        optimizer: *mut rp_optimizer,
        beta1: c_double,
        beta2: c_double,
    ) -> rp_status;
    pub fn rp_optimizer_set_eps(optimizer: *mut rp_optimizer, eps: c_double) -> rp_status;
    pub fn rp_optimizer_set_weight_decay(
        optimizer: *mut rp_optimizer,
        weight_decay: c_double,
    ) -> rp_status;
    pub fn rp_optimizer_set_momentum(optimizer: *mut rp_optimizer, momentum: c_double)
        -> rp_status;
    pub fn rp_adam_apply(
        params: *const *mut DLManagedTensor,
        grads: *const *const DLManagedTensor,
        exp_avgs: *const *mut DLManagedTensor,
        exp_avg_sqs: *const *mut DLManagedTensor,
        steps: *const i64,
        n_tensors: usize,
        lr: c_double,
        beta1: c_double,
        beta2: c_double,
        eps: c_double,
        weight_decay: c_double,
        decoupled_weight_decay: i32,
    ) -> rp_status;
    pub fn rp_step(
        model: *mut rp_model,
        optimizer: *const rp_optimizer,
        is_async: i32,
    ) -> rp_status;
    pub fn rp_step_callback(
        model: *mut rp_model,
        fn_: rp_step_fn,
        user_data: *mut c_void,
        is_async: i32,
    ) -> rp_status;
    pub fn rp_model_set_step_in_call(
        model: *mut rp_model,
        optimizer: *const rp_optimizer,
    ) -> rp_status;
    pub fn rp_model_step_in_call(out_enabled: *mut i32, model: *const rp_model) -> rp_status;
    pub fn rp_synchronize(model: *mut rp_model) -> rp_status;
    pub fn rp_zero_grad(model: *mut rp_model) -> rp_status;

    // Parameters
    pub fn rp_param_count(out_count: *mut usize, model: *const rp_model) -> rp_status;
    pub fn rp_param_name(
        out_name: *mut *const c_char,
        model: *const rp_model,
        index: usize,
    ) -> rp_status;
    pub fn rp_param_find(
        out_index: *mut usize,
        model: *const rp_model,
        name: *const c_char,
    ) -> rp_status;
    pub fn rp_param_hf_name(
        out_name: *mut *const c_char,
        model: *const rp_model,
        index: usize,
    ) -> rp_status;
    pub fn rp_param_kind_of(out_kind: *mut i32, model: *const rp_model, index: usize) -> rp_status;
    pub fn rp_param_shape(
        out_shape: *mut i64,
        out_ndim: *mut i32,
        capacity: i32,
        model: *const rp_model,
        index: usize,
    ) -> rp_status;
    pub fn rp_param_master(
        out_tensor: *mut *mut DLManagedTensor,
        model: *mut rp_model,
        index: usize,
    ) -> rp_status;
    pub fn rp_param_grad(
        out_tensor: *mut *mut DLManagedTensor,
        model: *mut rp_model,
        index: usize,
    ) -> rp_status;
    pub fn rp_param_grad_received(
        out_received: *mut i32,
        model: *const rp_model,
        index: usize,
    ) -> rp_status;

    // Weights on disk
    pub fn rp_model_save(model: *mut rp_model, path: *const c_char) -> rp_status;
    pub fn rp_model_load(model: *mut rp_model, path: *const c_char) -> rp_status;

    // Hugging Face models
    pub fn rp_model_create_from_hf(
        out_model: *mut *mut rp_model,
        dir: *const c_char,
        options: *const rp_model_options,
    ) -> rp_status;
    pub fn rp_model_create_from_hf_config(
        out_model: *mut *mut rp_model,
        config_json: *const c_char,
        options: *const rp_model_options,
    ) -> rp_status;
    pub fn rp_model_load_hf(model: *mut rp_model, dir: *const c_char) -> rp_status;
    pub fn rp_model_save_hf(model: *mut rp_model, dir: *const c_char) -> rp_status;
    pub fn rp_model_lora(
        out_rank: *mut i32,
        out_alpha: *mut f64,
        out_dropout: *mut f64,
        out_target_modules: *mut *const c_char,
        model: *const rp_model,
    ) -> rp_status;
    pub fn rp_model_save_lora(
        model: *mut rp_model,
        dir: *const c_char,
        base_model: *const c_char,
    ) -> rp_status;
    pub fn rp_model_load_lora(model: *mut rp_model, dir: *const c_char) -> rp_status;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, size_of};

    // Layouts of the DLPack structs on LP64, as the specification gives them.
    #[test]
    fn dlpack_layouts_match_the_c_structs() {
        assert_eq!(size_of::<DLDevice>(), 8);
        assert_eq!(size_of::<DLDataType>(), 4);
        assert_eq!(size_of::<DLTensor>(), 48);
        assert_eq!(align_of::<DLTensor>(), 8);
        assert_eq!(size_of::<DLManagedTensor>(), 64);
        assert_eq!(size_of::<DLManagedTensorVersioned>(), 80);
        assert_eq!(size_of::<rp_log_fn>(), size_of::<usize>());
    }

    #[test]
    fn library_abi_version_matches_this_crate() {
        let v = unsafe { rp_abi_version() };
        assert_eq!(v, RP_ABI_VERSION);
    }
}
