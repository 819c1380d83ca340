//! The model: build, train, step, inspect, save and load.

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};

use roundpipe_sys as sys;

use crate::config::{ModelOptions, RunConfig};
use crate::error::{c_string, check, Error, Result, Status};
use crate::layer::{LayerDef, LayerState, ParamKind};
use crate::loss::{panic_message, Loss};
use crate::optim::Optimizer;
use crate::tensor::{borrowed_managed, optional_managed, AsDlpack, DlTensor};
use crate::tensor_list::{take_list, take_list_optional};

// rp_model_stage_plan and rp_model_backward_stage_plan share this signature, and so do their
// setters.
type PlanQuery =
    unsafe extern "C" fn(*mut i32, *mut i32, i32, *const sys::rp_model) -> sys::rp_status;
type PlanSetter = unsafe extern "C" fn(*mut sys::rp_model, *const i32, usize) -> sys::rp_status;

/// A model: layers, host parameter store, optimizer state, device workers and threads.
///
/// `Send` but not `Sync`: one thread drives a model at a time (the header's rule), which the
/// `&mut self` of every driving method enforces. Dropping it drains the pipeline and the
/// optimizer thread first.
pub struct Model {
    ptr: NonNull<sys::rp_model>,
    // Step closures the optimizer thread may still run; freed once the library is done. Boxed:
    // each one's address is a callback's user_data and must not move when the Vec grows.
    #[allow(clippy::vec_box)]
    pending_steps: Vec<Box<StepState>>,
    // The closures of the model's caller-defined layers: their addresses are the layers'
    // user_data, so they live as long as the model (dropped after rp_model_destroy).
    layers: Vec<Arc<LayerState>>,
}

// SAFETY: the library allows a model to be driven from any one thread at a time.
unsafe impl Send for Model {}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("layers", &self.num_layers().ok())
            .field("stages", &self.num_stages().ok())
            .field("devices", &self.num_devices().ok())
            .finish()
    }
}

fn c_path(path: &Path) -> Result<CString> {
    let s = path
        .to_str()
        .ok_or_else(|| Error::invalid(format!("path {:?} is not UTF-8", path)))?;
    CString::new(s).map_err(|_| Error::invalid("path contains a NUL byte"))
}

/// Host memory held by a model's parameter state, from [`Model::host_state_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostStateBytes {
    /// Tensor bytes of master weights, device weight copies, gradient buffers and built-in
    /// optimizer state (allocator padding excluded).
    pub bytes: i64,
    /// Number of parameter elements (tied parameters once).
    pub elements: i64,
}

impl HostStateBytes {
    /// `bytes / elements` (0 for a model without parameters).
    pub fn bytes_per_param(&self) -> f64 {
        if self.elements == 0 {
            0.0
        } else {
            self.bytes as f64 / self.elements as f64
        }
    }
}

/// Parameter access from inside a step closure (runs on the optimizer thread).
pub struct StepContext {
    model: *mut sys::rp_model,
}

impl StepContext {
    /// Number of parameter tensors.
    pub fn param_count(&self) -> Result<usize> {
        param_count(self.model)
    }

    /// Name of parameter `index` ("3.weight").
    pub fn param_name(&self, index: usize) -> Result<String> {
        param_string(sys::rp_param_name, self.model, index)
    }

    /// Hugging Face tensor name of parameter `index` (models built from a Hugging Face config).
    pub fn param_hf_name(&self, index: usize) -> Result<String> {
        param_string(sys::rp_param_hf_name, self.model, index)
    }

    /// The fp32 master weight of parameter `index`: update it in place.
    pub fn master(&mut self, index: usize) -> Result<DlTensor> {
        param_view(self.model, index, false)
    }

    /// The gradient of this step for parameter `index`: f32, or bf16 for a bf16 / f16 model
    /// built with [`HostMemoryMode::Saving`](crate::HostMemoryMode::Saving) (check `dtype()`).
    pub fn grad(&mut self, index: usize) -> Result<DlTensor> {
        param_view(self.model, index, true)
    }

    /// Whether this step's gradient of parameter `index` received anything: false for a
    /// parameter no training call reached (and for frozen ones), which an update should leave
    /// alone, as the built-in optimizers and `torch.optim` do.
    pub fn grad_received(&self, index: usize) -> Result<bool> {
        let mut received = 0i32;
        check(unsafe { sys::rp_param_grad_received(&mut received, self.model, index) })?;
        Ok(received != 0)
    }
}

type StepFn = dyn FnOnce(&mut StepContext) -> std::result::Result<(), String> + Send;

struct StepState {
    f: Mutex<Option<Box<StepFn>>>,
    error: Mutex<Option<String>>,
}

unsafe extern "C" fn step_trampoline(model: *mut sys::rp_model, user_data: *mut c_void) -> i32 {
    if user_data.is_null() {
        return 1;
    }
    // SAFETY: user_data is a StepState kept alive by the Model until the step has run.
    let state = &*(user_data as *const StepState);
    let f = state.f.lock().unwrap_or_else(|e| e.into_inner()).take();
    let f = match f {
        Some(f) => f,
        None => return 1,
    };
    let result = catch_unwind(AssertUnwindSafe(move || f(&mut StepContext { model })));
    let msg = match result {
        Ok(Ok(())) => return 0,
        Ok(Err(m)) => format!("step callback failed: {}", m),
        Err(p) => format!("step callback panicked: {}", panic_message(&*p)),
    };
    *state.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
    1
}

fn param_count(model: *const sys::rp_model) -> Result<usize> {
    let mut n = 0usize;
    check(unsafe { sys::rp_param_count(&mut n, model) })?;
    Ok(n)
}

type ParamStringFn =
    unsafe extern "C" fn(*mut *const c_char, *const sys::rp_model, usize) -> sys::rp_status;

/// A library-owned name of parameter `index` (`rp_param_name`, `rp_param_hf_name`), copied.
fn param_string(f: ParamStringFn, model: *const sys::rp_model, index: usize) -> Result<String> {
    let mut p = ptr::null();
    check(unsafe { f(&mut p, model, index) })?;
    // SAFETY: library-owned, valid while the model lives; copied at once.
    Ok(unsafe { c_string(p) })
}

fn param_view(model: *mut sys::rp_model, index: usize, grad: bool) -> Result<DlTensor> {
    let mut p = ptr::null_mut();
    check(unsafe {
        if grad {
            sys::rp_param_grad(&mut p, model, index)
        } else {
            sys::rp_param_master(&mut p, model, index)
        }
    })?;
    // SAFETY: the library hands us a new reference that we own.
    unsafe { DlTensor::from_raw(p) }
        .ok_or_else(|| Error::new(Status::Internal, "NULL parameter view"))
}

type CreateFn = unsafe extern "C" fn(
    *mut *mut sys::rp_model,
    *const c_char,
    *const sys::rp_model_options,
) -> sys::rp_status;

impl Model {
    /// Build a model from a JSON spec (`{"layers": [...]}`, see docs/semantics.md); `None`
    /// options mean the defaults.
    pub fn new(spec_json: &str, options: Option<&ModelOptions>) -> Result<Model> {
        crate::ensure_abi()?;
        let spec =
            CString::new(spec_json).map_err(|_| Error::invalid("spec contains a NUL byte"))?;
        Model::create(sys::rp_model_create, &spec, options, "rp_model_create")
    }

    /// Build a Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM / LlamaForCausalLM from the
    /// text of its config.json, with weights initialised from the seed as transformers does.
    pub fn from_hf_config(config_json: &str, options: Option<&ModelOptions>) -> Result<Model> {
        crate::ensure_abi()?;
        let config =
            CString::new(config_json).map_err(|_| Error::invalid("config contains a NUL byte"))?;
        let f = sys::rp_model_create_from_hf_config;
        Model::create(f, &config, options, "rp_model_create_from_hf_config")
    }

    /// Build a Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM / LlamaForCausalLM from a
    /// model directory
    /// (config.json and the weights, one file or shards).
    pub fn from_hf_dir(dir: impl AsRef<Path>, options: Option<&ModelOptions>) -> Result<Model> {
        crate::ensure_abi()?;
        let dir = c_path(dir.as_ref())?;
        Model::create(
            sys::rp_model_create_from_hf,
            &dir,
            options,
            "rp_model_create_from_hf",
        )
    }

    /// Own the model `create(out, text, options)` makes.
    fn create(
        create: CreateFn,
        text: &CString,
        options: Option<&ModelOptions>,
        name: &str,
    ) -> Result<Model> {
        let mut p = ptr::null_mut();
        let opts = options.map_or(ptr::null(), |o| o.as_ptr());
        // SAFETY: valid out-pointer, NUL-terminated text, options borrowed for the call.
        check(unsafe { create(&mut p, text.as_ptr(), opts) })?;
        let ptr = NonNull::new(p)
            .ok_or_else(|| Error::new(Status::Internal, format!("{} returned NULL", name)))?;
        Ok(Model {
            ptr,
            pending_steps: Vec::new(),
            layers: Vec::new(),
        })
    }

    /// Build a model that mixes built-in layers and the caller-defined `layers`: in the spec,
    /// `{"type": "caller", "def": i}` is `layers[i]`, and each is used exactly once.
    pub fn with_layers(
        spec_json: &str,
        layers: Vec<LayerDef>,
        options: Option<&ModelOptions>,
    ) -> Result<Model> {
        crate::ensure_abi()?;
        let spec =
            CString::new(spec_json).map_err(|_| Error::invalid("spec contains a NUL byte"))?;
        let defs: Vec<*const sys::rp_layer_def> = layers.iter().map(|l| l.as_ptr()).collect();
        let mut p = ptr::null_mut();
        let opts = options.map_or(ptr::null(), |o| o.as_ptr());
        // SAFETY: the defs are borrowed for the call (the model copies them); the closures
        // they point at are kept below for the model's lifetime.
        check(unsafe {
            sys::rp_model_create_with_layers(&mut p, spec.as_ptr(), defs.as_ptr(), defs.len(), opts)
        })?;
        let ptr = NonNull::new(p).ok_or_else(|| {
            Error::new(
                Status::Internal,
                "rp_model_create_with_layers returned NULL",
            )
        })?;
        Ok(Model {
            ptr,
            pending_steps: Vec::new(),
            layers: layers.iter().map(|l| l.state()).collect(),
        })
    }

    /// A failed call's error, with the messages of caller-defined layers that failed in it.
    fn with_layer_details(&self, e: Error) -> Error {
        if e.status() != Status::Callback {
            return e;
        }
        let details: Vec<String> = self.layers.iter().filter_map(|l| l.take_error()).collect();
        e.with_detail(&details.join("; "))
    }

    fn clear_layer_errors(&self) {
        for l in &self.layers {
            l.take_error();
        }
    }

    /// The raw handle, for calls of `roundpipe-sys` this crate does not wrap.
    pub fn as_ptr(&mut self) -> *mut sys::rp_model {
        self.ptr.as_ptr()
    }

    /// Number of layers.
    pub fn num_layers(&self) -> Result<i32> {
        let mut n = 0;
        check(unsafe { sys::rp_model_num_layers(&mut n, self.ptr.as_ptr()) })?;
        Ok(n)
    }

    /// Number of stages of the current plan.
    pub fn num_stages(&self) -> Result<i32> {
        let mut n = 0;
        check(unsafe { sys::rp_model_num_stages(&mut n, self.ptr.as_ptr()) })?;
        Ok(n)
    }

    /// Number of worker devices.
    pub fn num_devices(&self) -> Result<i32> {
        let mut n = 0;
        check(unsafe { sys::rp_model_num_devices(&mut n, self.ptr.as_ptr()) })?;
        Ok(n)
    }

    /// The loss scale (0 when loss scaling is off) and the steps skipped so far for inf or
    /// nan gradients (`rp_model_grad_scale`).
    pub fn grad_scale(&self) -> Result<(f64, i64)> {
        let (mut scale, mut skipped) = (0.0, 0i64);
        check(unsafe { sys::rp_model_grad_scale(&mut scale, &mut skipped, self.ptr.as_ptr()) })?;
        Ok((scale, skipped))
    }

    /// Switch dynamic loss scaling on this model (`initial_scale` > 0, restarting the schedule)
    /// or off (0), as `ModelOptions::set_grad_scaler` does at creation. Steps already queued
    /// finish first, with the old setting (`rp_model_set_grad_scaler`).
    pub fn set_grad_scaler(&mut self, initial_scale: f64, growth_interval: i32) -> Result<()> {
        check(unsafe {
            sys::rp_model_set_grad_scaler(self.ptr.as_ptr(), initial_scale, growth_interval)
        })
    }

    /// Skip (true) or run (false) steps whose gradients hold inf or nan, from the next step on
    /// (`rp_model_set_skip_nonfinite_steps`).
    pub fn set_skip_nonfinite_steps(&mut self, skip: bool) -> Result<()> {
        check(unsafe { sys::rp_model_set_skip_nonfinite_steps(self.ptr.as_ptr(), skip as i32) })
    }

    /// Number of optimizer steps enqueued so far.
    pub fn step_count(&self) -> Result<i64> {
        let mut n = 0;
        check(unsafe { sys::rp_model_step_count(&mut n, self.ptr.as_ptr()) })?;
        Ok(n)
    }

    /// The current stage plan, as the engine decided it (the explicit plan of the options,
    /// else the planner's; on GPUs, re-planned from measured times by the third training
    /// call): stage `s` holds the next `plan[s]` layers, so the counts add up to
    /// [`num_layers`](Self::num_layers).
    pub fn stage_plan(&self) -> Result<Vec<i32>> {
        self.read_plan(sys::rp_model_stage_plan)
    }

    /// A stage plan the engine's planner makes for the layers without changing the model
    /// (`rp_model_plan_stages`; apply it with [`set_stage_plan`](Self::set_stage_plan)): each
    /// stage's weights and gradients (model dtype, plus workspaces) at most `max_stage_bytes`
    /// (0: no limit), at least `min_stages` stages (at most one per layer). An error names a
    /// layer that alone is over the limit.
    pub fn plan_stages(&self, max_stage_bytes: i64, min_stages: i32) -> Result<Vec<i32>> {
        let mut plan = vec![0i32; self.num_layers()?.max(1) as usize];
        let (mut n, capacity) = (0i32, plan.len() as i32);
        // SAFETY: `plan` holds `capacity` counts; the library writes at most that many.
        check(unsafe {
            sys::rp_model_plan_stages(
                plan.as_mut_ptr(),
                &mut n,
                capacity,
                self.ptr.as_ptr(),
                max_stage_bytes,
                min_stages,
            )
        })?;
        plan.truncate(n.max(0) as usize);
        Ok(plan)
    }

    /// Replace the stage plan (`rp_model_set_stage_plan`): stage `s` holds the next
    /// `layers_per_stage[s]` layers; an empty slice returns to the automatic planner. Refused
    /// (plan unchanged) for bad counts, or while a `forward_train` awaits its `backward`. A
    /// backward stage plan set before is dropped.
    pub fn set_stage_plan(&mut self, layers_per_stage: &[i32]) -> Result<()> {
        self.write_plan(sys::rp_model_set_stage_plan, layers_per_stage)
    }

    /// The backward stage plan in force (`rp_model_backward_stage_plan`): the one
    /// [`set_backward_stage_plan`](Self::set_backward_stage_plan) set, else the forward stages
    /// of [`stage_plan`](Self::stage_plan).
    pub fn backward_stage_plan(&self) -> Result<Vec<i32>> {
        self.read_plan(sys::rp_model_backward_stage_plan)
    }

    /// Backward stages that differ from the forward ones (`rp_model_set_backward_stage_plan`,
    /// upstream's asymmetric execute plans): backward stage `b` holds the next
    /// `layers_per_stage[b]` layers from layer 0; an empty slice goes back to the forward
    /// stages. Needs an explicit forward plan ([`set_stage_plan`](Self::set_stage_plan)); a
    /// fused [`forward_backward`](Self::forward_backward) needs both plans to end with the same
    /// stage (the tail). Refused (plan unchanged) for bad counts, without an explicit forward
    /// plan, or while a `forward_train` awaits its `backward`.
    pub fn set_backward_stage_plan(&mut self, layers_per_stage: &[i32]) -> Result<()> {
        self.write_plan(sys::rp_model_set_backward_stage_plan, layers_per_stage)
    }

    // rp_model_set_stage_plan / rp_model_set_backward_stage_plan.
    fn write_plan(&mut self, set: PlanSetter, layers_per_stage: &[i32]) -> Result<()> {
        // SAFETY: the counts are borrowed for the call; the library copies them.
        check(unsafe {
            set(
                self.ptr.as_ptr(),
                layers_per_stage.as_ptr(),
                layers_per_stage.len(),
            )
        })
    }

    // rp_model_stage_plan / rp_model_backward_stage_plan: ask for the count, then the plan.
    fn read_plan(&self, query: PlanQuery) -> Result<Vec<i32>> {
        let mut n = 0i32;
        check(unsafe { query(ptr::null_mut(), &mut n, 0, self.ptr.as_ptr()) })?;
        let mut plan = vec![0i32; n.max(0) as usize];
        let capacity = plan.len() as i32;
        check(unsafe { query(plan.as_mut_ptr(), &mut n, capacity, self.ptr.as_ptr()) })?;
        plan.truncate(n.max(0) as usize);
        Ok(plan)
    }

    /// The run configuration a call given `call` would use: the model's configuration
    /// overlaid by `call` field by field, every field still unset filled in with the built-in
    /// default (num_microbatch: number of devices + 1; grain: stage; output: the CPU; merged
    /// outputs). Read it with the [`RunConfig`] getters.
    pub fn resolve_run_config(&self, call: Option<&RunConfig>) -> Result<RunConfig> {
        let mut p = ptr::null_mut();
        let call = call.map_or(ptr::null(), |c| c.as_ptr());
        check(unsafe { sys::rp_model_resolve_run_config(&mut p, self.ptr.as_ptr(), call) })?;
        // SAFETY: a new configuration the caller owns.
        unsafe { RunConfig::from_raw(p, "rp_model_resolve_run_config") }
    }

    /// Host memory held by the parameter state: master weights, weight copies the devices read,
    /// gradient buffers and built-in optimizer state (allocated at the first built-in step).
    /// After a built-in AdamW step a bf16 model holds 24 bytes per parameter with
    /// [`HostMemoryMode::Standard`](crate::HostMemoryMode::Standard) and 12 with
    /// [`HostMemoryMode::Saving`](crate::HostMemoryMode::Saving) (28 and 12 for f32 models).
    pub fn host_state_bytes(&self) -> Result<HostStateBytes> {
        let (mut bytes, mut elements) = (0i64, 0i64);
        check(unsafe {
            sys::rp_model_host_state_bytes(&mut bytes, &mut elements, self.ptr.as_ptr())
        })?;
        Ok(HostStateBytes { bytes, elements })
    }

    /// This process's data-parallel rank and the number of ranks, as the engine joined
    /// (`rp_model_data_parallel`; `(0, 1)` without data parallelism).
    pub fn data_parallel(&self) -> Result<(i32, i32)> {
        let (mut rank, mut world_size) = (0i32, 0i32);
        check(unsafe {
            sys::rp_model_data_parallel(&mut rank, &mut world_size, self.ptr.as_ptr())
        })?;
        Ok((rank, world_size))
    }

    /// Timing record of the model's last [`forward`](Self::forward) or
    /// [`forward_backward`](Self::forward_backward), as Chrome trace JSON (open it in
    /// chrome://tracing or Perfetto): one process per device and one for the host, one thread
    /// per stream, one complete event per transfer or microbatch computation, times in
    /// microseconds from the call's start (`rp_model_trace_json` gives every field).
    pub fn trace_json(&mut self) -> Result<String> {
        let mut json: *const c_char = ptr::null();
        check(unsafe { sys::rp_model_trace_json(&mut json, self.ptr.as_ptr()) })?;
        // SAFETY: library-owned text, valid until the next call on this model; copied now.
        Ok(unsafe { c_string(json) })
    }

    /// Inference on the published weights: returns the outputs (one tensor when merged, else
    /// one per microbatch). `config` overrides the model's run configuration for this call.
    pub fn forward(
        &mut self,
        inputs: &[&dyn AsDlpack],
        config: Option<&RunConfig>,
    ) -> Result<Vec<DlTensor>> {
        self.call_forward(sys::rp_forward, inputs, config)
    }

    /// Upstream's non-fused training, first half: a forward in training mode whose outputs
    /// `backward` can back-propagate later (`rp_forward_train`). Outputs as for `forward`.
    pub fn forward_train(
        &mut self,
        inputs: &[&dyn AsDlpack],
        config: Option<&RunConfig>,
    ) -> Result<Vec<DlTensor>> {
        self.call_forward(sys::rp_forward_train, inputs, config)
    }

    /// `rp_forward` or `rp_forward_train` (same signature) on borrowed inputs.
    fn call_forward(
        &mut self,
        entry: unsafe extern "C" fn(
            *mut *mut sys::rp_tensor_list,
            *mut sys::rp_model,
            *const *const sys::DLManagedTensor,
            usize,
            *const sys::rp_run_config,
        ) -> sys::rp_status,
        inputs: &[&dyn AsDlpack],
        config: Option<&RunConfig>,
    ) -> Result<Vec<DlTensor>> {
        let managed = borrowed_managed(inputs);
        let ptrs: Vec<*const sys::DLManagedTensor> =
            managed.iter().map(|m| m as *const _).collect();
        let mut list = ptr::null_mut();
        self.clear_layer_errors();
        // SAFETY: the inputs are borrowed for the call and outlive it.
        check(unsafe {
            entry(
                &mut list,
                self.ptr.as_ptr(),
                ptrs.as_ptr(),
                ptrs.len(),
                config.map_or(ptr::null(), |c| c.as_ptr()),
            )
        })
        .map_err(|e| self.with_layer_details(e))?;
        take_list(list)
    }

    /// Second half (`rp_backward`): the gradients of the last `forward_train`'s outputs, laid
    /// out as it returned them (`None`: no gradient for that output); the parameter gradients
    /// accumulate until the next step.
    pub fn backward(&mut self, output_grads: &[Option<&dyn AsDlpack>]) -> Result<()> {
        let (_managed, ptrs) = optional_managed(output_grads);
        self.clear_layer_errors();
        // SAFETY: the gradients are borrowed for the call and outlive it.
        check(unsafe { sys::rp_backward(self.ptr.as_ptr(), ptrs.as_ptr(), ptrs.len()) })
            .map_err(|e| self.with_layer_details(e))
    }

    /// `backward` that also returns the gradient of every input of the last `forward_train`
    /// (`rp_backward_input_grads`): one per input, in its shape and dtype; `None` for inputs
    /// that are not floating point or that no layer reads. Chains models: the input gradients
    /// of one are the output gradients of the model that produced its inputs.
    pub fn backward_input_grads(
        &mut self,
        output_grads: &[Option<&dyn AsDlpack>],
    ) -> Result<Vec<Option<DlTensor>>> {
        let (_managed, ptrs) = optional_managed(output_grads);
        self.clear_layer_errors();
        let mut list = ptr::null_mut();
        // SAFETY: the gradients are borrowed for the call and outlive it; list is an out-pointer.
        check(unsafe {
            sys::rp_backward_input_grads(&mut list, self.ptr.as_ptr(), ptrs.as_ptr(), ptrs.len())
        })
        .map_err(|e| self.with_layer_details(e))?;
        take_list_optional(list)
    }

    /// Training: forward, loss and backward of every microbatch in one pipelined pass. Returns
    /// the sum of the microbatch losses; gradients accumulate until the next step. `loss`
    /// `None` means the model's output is the loss.
    pub fn forward_backward(
        &mut self,
        inputs: &[&dyn AsDlpack],
        labels: Option<&dyn AsDlpack>,
        loss: Option<&Loss>,
        config: Option<&RunConfig>,
    ) -> Result<f64> {
        self.forward_backward_impl(inputs, labels, loss, config, false)
            .map(|(l, _)| l)
    }

    /// As [`forward_backward`](Self::forward_backward), also returning the merged outputs.
    pub fn forward_backward_with_outputs(
        &mut self,
        inputs: &[&dyn AsDlpack],
        labels: Option<&dyn AsDlpack>,
        loss: Option<&Loss>,
        config: Option<&RunConfig>,
    ) -> Result<(f64, Vec<DlTensor>)> {
        self.forward_backward_impl(inputs, labels, loss, config, true)
    }

    fn forward_backward_impl(
        &mut self,
        inputs: &[&dyn AsDlpack],
        labels: Option<&dyn AsDlpack>,
        loss: Option<&Loss>,
        config: Option<&RunConfig>,
        want_outputs: bool,
    ) -> Result<(f64, Vec<DlTensor>)> {
        let managed = borrowed_managed(inputs);
        let ptrs: Vec<*const sys::DLManagedTensor> =
            managed.iter().map(|m| m as *const _).collect();
        let label_managed = labels.map(|l| borrowed_managed(&[l]));
        let label_ptr = label_managed
            .as_ref()
            .map_or(ptr::null(), |v| &v[0] as *const _);
        if let Some(state) = loss.and_then(|l| l.state()) {
            state.take_error();
        }
        self.clear_layer_errors();
        let mut value = 0.0f64;
        let mut list = ptr::null_mut();
        // SAFETY: everything is borrowed for the call and outlives it.
        let status = unsafe {
            sys::rp_forward_backward(
                &mut value,
                if want_outputs {
                    &mut list
                } else {
                    ptr::null_mut()
                },
                self.ptr.as_ptr(),
                ptrs.as_ptr(),
                ptrs.len(),
                label_ptr,
                loss.map_or(ptr::null(), |l| l.as_ptr()),
                config.map_or(ptr::null(), |c| c.as_ptr()),
            )
        };
        if let Err(e) = check(status) {
            let detail = loss.and_then(|l| l.state()).and_then(|s| s.take_error());
            return Err(match detail {
                Some(d) if e.status() == Status::Callback => e.with_detail(&d),
                _ => self.with_layer_details(e),
            });
        }
        let outputs = if want_outputs && !list.is_null() {
            take_list(list)?
        } else {
            Vec::new()
        };
        Ok((value, outputs))
    }

    /// One built-in optimizer step on the gradients accumulated since the previous step.
    /// Asynchronous (`is_async`, recommended): returns at once, and the next `forward_backward`
    /// runs on the weights from before this step (staleness 1).
    pub fn step(&mut self, optimizer: &Optimizer, is_async: bool) -> Result<()> {
        let status =
            unsafe { sys::rp_step(self.ptr.as_ptr(), optimizer.as_ptr(), is_async as i32) };
        let r = self.check_steps(status);
        self.forget_finished_steps(status);
        r
    }

    /// Steps inside the training calls (`rp_model_set_step_in_call`; models built with
    /// [`HostMemoryMode::Saving`](crate::HostMemoryMode::Saving) only). With `Some(optimizer)`,
    /// every later `forward_backward` is also the optimizer step over its own gradients: it
    /// leaves the weights `forward_backward` followed by a synchronous [`step`](Self::step)
    /// would, bit for bit, but each parameter is updated on the optimizer thread as soon as its
    /// gradient is final, so the step hides behind the backward. The settings are copied (pass
    /// the optimizer again after changing it); `None` switches back to explicit steps.
    ///
    /// While on, one call is one step (no accumulation over calls), [`step`](Self::step) and
    /// [`step_with`](Self::step_with) fail with `Status::State`, a parameter without a gradient
    /// in the call is left alone, and so is one whose gradient holds inf or nan (the step is
    /// counted as skipped, unless [`set_skip_nonfinite_steps`](Self::set_skip_nonfinite_steps)
    /// says otherwise). A call that fails in its backward keeps the updates already made and
    /// drops the other gradients.
    ///
    /// Fails with `Status::State`, nothing changed, for a model in
    /// [`HostMemoryMode::Standard`](crate::HostMemoryMode::Standard), with loss scaling,
    /// holding optimizer state of another kind, or holding gradients accumulated since its last
    /// step ([`step`](Self::step) or [`zero_grad`](Self::zero_grad) first). With data
    /// parallelism each rank updates from the averaged gradients.
    pub fn set_step_in_call(&mut self, optimizer: Option<&Optimizer>) -> Result<()> {
        let opt = optimizer.map_or(std::ptr::null(), |o| o.as_ptr());
        check(unsafe { sys::rp_model_set_step_in_call(self.ptr.as_ptr(), opt) })
    }

    /// Whether each training call is also the optimizer step
    /// ([`set_step_in_call`](Self::set_step_in_call); `rp_model_step_in_call`).
    pub fn step_in_call(&self) -> Result<bool> {
        let mut on = 0;
        check(unsafe { sys::rp_model_step_in_call(&mut on, self.ptr.as_ptr()) })?;
        Ok(on != 0)
    }

    /// A step computed by `f` on the optimizer thread: it gets the master weights and this
    /// step's gradients through [`StepContext`] and updates the weights in place. An `Err` or a
    /// panic is reported by this call (sync) or by the next step / synchronize (async).
    pub fn step_with<F>(&mut self, f: F, is_async: bool) -> Result<()>
    where
        F: FnOnce(&mut StepContext) -> std::result::Result<(), String> + Send + 'static,
    {
        let state = Box::new(StepState {
            f: Mutex::new(Some(Box::new(f))),
            error: Mutex::new(None),
        });
        let user_data = &*state as *const StepState as *mut c_void;
        // SAFETY: the trampoline matches rp_step_fn; an async step's state stays in
        // pending_steps until the library has run it (next step, synchronize or drop).
        let status = unsafe {
            sys::rp_step_callback(
                self.ptr.as_ptr(),
                Some(step_trampoline),
                user_data,
                is_async as i32,
            )
        };
        let mut r = self.check_steps(status);
        if !is_async || status != sys::RP_OK {
            // This step has run (sync) or was refused: its own failure, if any, is known now.
            if let Some(d) = state.error.lock().unwrap_or_else(|e| e.into_inner()).take() {
                r = r.map_err(|e| e.with_detail(&d));
            }
        }
        self.forget_finished_steps(status);
        if status == sys::RP_OK && is_async {
            self.pending_steps.push(state);
        }
        r
    }

    /// After a call that waited for every earlier step (it returned OK, or CALLBACK for a failed
    /// earlier step), their closures can be freed. Other failures may have returned before
    /// waiting, so the closures are kept.
    fn forget_finished_steps(&mut self, status: sys::rp_status) {
        if status == sys::RP_OK || status == sys::RP_ERR_CALLBACK {
            self.pending_steps.clear();
        }
    }

    /// A status of a call that waits for earlier steps, with the message of a failed step
    /// closure attached.
    fn check_steps(&self, status: sys::rp_status) -> Result<()> {
        check(status).map_err(|e| {
            if e.status() != Status::Callback {
                return e;
            }
            let details: Vec<String> = self
                .pending_steps
                .iter()
                .filter_map(|s| s.error.lock().unwrap_or_else(|p| p.into_inner()).take())
                .collect();
            e.with_detail(&details.join("; "))
        })
    }

    /// Wait for every pending step and publish the latest master weights (a point where nothing
    /// is in flight).
    pub fn synchronize(&mut self) -> Result<()> {
        let status = unsafe { sys::rp_synchronize(self.ptr.as_ptr()) };
        let r = self.check_steps(status);
        self.forget_finished_steps(status);
        r
    }

    /// Drop the gradients accumulated since the last step.
    pub fn zero_grad(&mut self) -> Result<()> {
        check(unsafe { sys::rp_zero_grad(self.ptr.as_ptr()) })
    }

    /// Number of parameter tensors.
    pub fn param_count(&self) -> Result<usize> {
        param_count(self.ptr.as_ptr())
    }

    /// Name of parameter `index` ("<layer>.<name>", e.g. "3.fc1.weight").
    pub fn param_name(&self, index: usize) -> Result<String> {
        param_string(sys::rp_param_name, self.ptr.as_ptr(), index)
    }

    /// Hugging Face tensor name of parameter `index` ("model.layers.2.mlp.up_proj.weight"),
    /// the name [`save_hf`](Self::save_hf) writes. [`Status::State`] for a model not built
    /// from a Hugging Face config.
    pub fn param_hf_name(&self, index: usize) -> Result<String> {
        param_string(sys::rp_param_hf_name, self.ptr.as_ptr(), index)
    }

    /// Names of all parameters, in order.
    pub fn param_names(&self) -> Result<Vec<String>> {
        (0..self.param_count()?)
            .map(|i| self.param_name(i))
            .collect()
    }

    /// Index of the parameter called `name`.
    pub fn param_find(&self, name: &str) -> Result<usize> {
        let c = CString::new(name).map_err(|_| Error::invalid("name contains a NUL byte"))?;
        let mut i = 0usize;
        check(unsafe { sys::rp_param_find(&mut i, self.ptr.as_ptr(), c.as_ptr()) })?;
        Ok(i)
    }

    /// What parameter `index` is: trainable, frozen, or a buffer (frozen: a caller-defined
    /// layer's, or every non-adapter parameter of a LoRA model; frozen parameters and buffers
    /// have no gradient and no optimizer state).
    pub fn param_kind(&self, index: usize) -> Result<ParamKind> {
        let mut kind = 0i32;
        check(unsafe { sys::rp_param_kind_of(&mut kind, self.ptr.as_ptr(), index) })?;
        ParamKind::from_code(kind)
    }

    /// Shape of parameter `index`.
    pub fn param_shape(&self, index: usize) -> Result<Vec<i64>> {
        let mut ndim = 0i32;
        check(unsafe {
            sys::rp_param_shape(ptr::null_mut(), &mut ndim, 0, self.ptr.as_ptr(), index)
        })?;
        let mut shape = vec![0i64; ndim.max(0) as usize];
        check(unsafe {
            sys::rp_param_shape(
                shape.as_mut_ptr(),
                &mut ndim,
                ndim,
                self.ptr.as_ptr(),
                index,
            )
        })?;
        Ok(shape)
    }

    /// Zero-copy view of the fp32 master weight of parameter `index` (read it after
    /// `synchronize`; writes take effect at the next synchronize or step).
    pub fn param_master(&mut self, index: usize) -> Result<DlTensor> {
        param_view(self.ptr.as_ptr(), index, false)
    }

    /// Zero-copy view of the gradient accumulated since the last step for parameter `index`
    /// (read it after `synchronize`; take a fresh view after each step). f32, or bf16 for a
    /// bf16 / f16 model built with [`HostMemoryMode::Saving`](crate::HostMemoryMode::Saving).
    pub fn param_grad(&mut self, index: usize) -> Result<DlTensor> {
        param_view(self.ptr.as_ptr(), index, true)
    }

    /// Save the latest weights to a safetensors file (synchronizes first).
    pub fn save(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let p = c_path(path.as_ref())?;
        check(unsafe { sys::rp_model_save(self.ptr.as_ptr(), p.as_ptr()) })
    }

    /// Load every parameter from a safetensors file (synchronizes first).
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let p = c_path(path.as_ref())?;
        check(unsafe { sys::rp_model_load(self.ptr.as_ptr(), p.as_ptr()) })
    }

    /// Save the latest weights as a Hugging Face directory that transformers loads
    /// (synchronizes first; a model built from a Hugging Face config).
    pub fn save_hf(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let p = c_path(dir.as_ref())?;
        check(unsafe { sys::rp_model_save_hf(self.ptr.as_ptr(), p.as_ptr()) })
    }

    /// Load the weights of a Hugging Face directory (synchronizes first; a model built from a
    /// Hugging Face config).
    pub fn load_hf(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let p = c_path(dir.as_ref())?;
        check(unsafe { sys::rp_model_load_hf(self.ptr.as_ptr(), p.as_ptr()) })
    }

    /// The model's LoRA configuration ([`ModelOptions::set_lora`](crate::ModelOptions::set_lora)),
    /// `None` for a model without adapters. The adapters are its trainable parameters.
    pub fn lora(&self) -> Result<Option<LoraConfig>> {
        let (mut rank, mut alpha, mut dropout) = (0i32, 0f64, 0f64);
        let mut targets: *const c_char = ptr::null();
        check(unsafe {
            sys::rp_model_lora(
                &mut rank,
                &mut alpha,
                &mut dropout,
                &mut targets,
                self.ptr.as_ptr(),
            )
        })?;
        if rank == 0 {
            return Ok(None);
        }
        // SAFETY: library-owned NUL-terminated text, valid while the model lives; copied here.
        let target_modules = unsafe { CStr::from_ptr(targets) }
            .to_string_lossy()
            .into_owned();
        Ok(Some(LoraConfig {
            rank,
            alpha,
            dropout,
            target_modules,
        }))
    }

    /// Save the adapters in PEFT's format (`adapter_config.json` and
    /// `adapter_model.safetensors`, which `PeftModel.from_pretrained` loads); synchronizes
    /// first. `base_model` is written as base_model_name_or_path.
    pub fn save_lora(&mut self, dir: impl AsRef<Path>, base_model: Option<&str>) -> Result<()> {
        let p = c_path(dir.as_ref())?;
        let base = base_model
            .map(|b| CString::new(b).map_err(|_| Error::invalid("base_model contains a NUL byte")))
            .transpose()?;
        let b = base.as_ref().map_or(ptr::null(), |c| c.as_ptr());
        check(unsafe { sys::rp_model_save_lora(self.ptr.as_ptr(), p.as_ptr(), b) })
    }

    /// Load adapters saved by [`save_lora`](Self::save_lora) or by PEFT; the directory must
    /// describe this model's adapters (rank, alpha, target modules, tensor shapes), else
    /// [`Status::InvalidArgument`] names the key or tensor and nothing changes.
    pub fn load_lora(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let p = c_path(dir.as_ref())?;
        check(unsafe { sys::rp_model_load_lora(self.ptr.as_ptr(), p.as_ptr()) })
    }
}

/// A model's LoRA configuration, as [`Model::lora`] reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub rank: i32,
    pub alpha: f64,
    pub dropout: f64,
    /// The adapted projections, comma-separated in layer order ("q_proj,v_proj").
    pub target_modules: String,
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once; destroy drains the optimizer thread, so the
        // pending step closures (dropped after this) are no longer used.
        unsafe { sys::rp_model_destroy(self.ptr.as_ptr()) }
    }
}
