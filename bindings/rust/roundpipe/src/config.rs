//! Run configuration and model options: owned handles with typed setters.

use std::ffi::CString;
use std::ptr::NonNull;
use std::time::Duration;

use roundpipe_sys as sys;

use crate::error::{check, Error, Result};
use crate::tensor::Device;

/// Which kind of device runs the stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// All visible GPUs, else CPU worker devices.
    Auto,
    /// CPU worker devices, even when GPUs are visible.
    Cpu,
    /// GPUs; model creation fails when none is visible.
    Cuda,
}

impl DeviceKind {
    fn code(self) -> i32 {
        match self {
            DeviceKind::Auto => sys::RP_DEVICE_AUTO,
            DeviceKind::Cpu => sys::RP_DEVICE_CPU,
            DeviceKind::Cuda => sys::RP_DEVICE_CUDA,
        }
    }
}

/// Floating-point types of weights and optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatType {
    /// Inherit / the built-in default.
    Default,
    F32,
    BF16,
    F16,
}

impl FloatType {
    fn code(self) -> i32 {
        match self {
            FloatType::Default => sys::RP_DTYPE_DEFAULT,
            FloatType::F32 => sys::RP_DTYPE_F32,
            FloatType::BF16 => sys::RP_DTYPE_BF16,
            FloatType::F16 => sys::RP_DTYPE_F16,
        }
    }
}

/// How host copies of the weights are pinned (ignored on CPU devices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinMode {
    Alloc,
    Register,
    Off,
}

/// Host memory layout of parameters, gradients and optimizer state (`rp_host_memory_mode`).
/// Bytes per parameter for bf16 / f16 models (f32 models in parentheses), built-in optimizer
/// state included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostMemoryMode {
    /// 24 (28) bytes: f32 master, f32 AdamW moments, two f32 gradient buffers and two
    /// model-dtype weight copies; an asynchronous step overlaps the whole next call and its
    /// weights are one step stale. The default.
    #[default]
    Standard,
    /// 12 (12) bytes: f32 master, AdamW moments (SGD momentum) in bf16 with stochastic
    /// rounding, one gradient buffer (bf16; f32 for f32 models) and one model-dtype weight copy
    /// (none for f32 models). Steps still overlap the next call, stage by stage, and weights
    /// are never stale. Gradients seen by a step closure are bf16 for bf16 / f16 models.
    Saving,
}

impl HostMemoryMode {
    fn code(self) -> i32 {
        match self {
            HostMemoryMode::Standard => sys::RP_HOST_MEMORY_STANDARD,
            HostMemoryMode::Saving => sys::RP_HOST_MEMORY_SAVING,
        }
    }
}

/// Granularity of activation recomputation in backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecomputeGrain {
    /// Inherit / the built-in default (stage); what an unset configuration reports.
    Default,
    Stage,
    Layer,
}

impl RecomputeGrain {
    fn code(self) -> i32 {
        match self {
            RecomputeGrain::Default => sys::RP_GRAIN_DEFAULT,
            RecomputeGrain::Stage => sys::RP_GRAIN_STAGE,
            RecomputeGrain::Layer => sys::RP_GRAIN_LAYER,
        }
    }

    fn from_code(code: i32) -> RecomputeGrain {
        match code {
            sys::RP_GRAIN_STAGE => RecomputeGrain::Stage,
            sys::RP_GRAIN_LAYER => RecomputeGrain::Layer,
            _ => RecomputeGrain::Default,
        }
    }
}

/// How an input (or the labels) is split into microbatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Along this dimension.
    Dim(i32),
    /// Every microbatch gets the whole tensor.
    Replicate,
}

impl Split {
    pub(crate) fn code(self) -> i32 {
        match self {
            Split::Dim(d) => d,
            Split::Replicate => sys::RP_SPLIT_REPLICATE,
        }
    }
}

/// A run configuration (upstream's `RoundPipeRunConfig`). Every field starts unset; a per-call
/// configuration overrides the model's field by field.
#[derive(Debug)]
pub struct RunConfig {
    ptr: NonNull<sys::rp_run_config>,
}

// SAFETY: the handle is plain data owned by this value; the header makes no promise about
// concurrent use, so RunConfig is Send but not Sync.
unsafe impl Send for RunConfig {}

impl RunConfig {
    /// A configuration with every field unset.
    pub fn new() -> Result<RunConfig> {
        crate::ensure_abi()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer.
        check(unsafe { sys::rp_run_config_create(&mut p) })?;
        // SAFETY: a new configuration we own.
        unsafe { RunConfig::from_raw(p, "rp_run_config_create") }
    }

    /// Own the configuration `p` (NULL is an internal error naming `from`).
    ///
    /// # Safety
    /// `p` is NULL or a configuration nobody else frees.
    pub(crate) unsafe fn from_raw(p: *mut sys::rp_run_config, from: &str) -> Result<RunConfig> {
        NonNull::new(p)
            .map(|ptr| RunConfig { ptr })
            .ok_or_else(|| Error::new(crate::Status::Internal, format!("{} returned NULL", from)))
    }

    pub(crate) fn as_ptr(&self) -> *const sys::rp_run_config {
        self.ptr.as_ptr()
    }

    /// Number of microbatches (>= 1; 0 unsets). Default: number of devices + 1.
    pub fn set_num_microbatch(&mut self, n: i32) -> Result<&mut Self> {
        check(unsafe { sys::rp_run_config_set_num_microbatch(self.ptr.as_ptr(), n) })?;
        Ok(self)
    }

    /// Recompute granularity.
    pub fn set_recompute_grain(&mut self, grain: RecomputeGrain) -> Result<&mut Self> {
        check(unsafe { sys::rp_run_config_set_recompute_grain(self.ptr.as_ptr(), grain.code()) })?;
        Ok(self)
    }

    /// Where outputs are returned: the CPU, or GPU `index` (`Some(index)`).
    pub fn set_output_device(&mut self, cuda_index: Option<i32>) -> Result<&mut Self> {
        let (kind, id) = match cuda_index {
            None => (sys::kDLCPU, 0),
            Some(i) => (sys::kDLCUDA, i),
        };
        check(unsafe { sys::rp_run_config_set_output_device(self.ptr.as_ptr(), kind, id) })?;
        Ok(self)
    }

    /// How input `index` is split into microbatches.
    pub fn set_input_split(&mut self, index: i32, split: Split) -> Result<&mut Self> {
        check(unsafe {
            sys::rp_run_config_set_input_split_dim(self.ptr.as_ptr(), index, split.code())
        })?;
        Ok(self)
    }

    /// How labels are split into microbatches.
    pub fn set_label_split(&mut self, split: Split) -> Result<&mut Self> {
        check(unsafe { sys::rp_run_config_set_label_split_dim(self.ptr.as_ptr(), split.code()) })?;
        Ok(self)
    }

    /// `Some(true)`: merge the microbatches' outputs into one tensor (default); `Some(false)`:
    /// one output per microbatch; `None`: unset.
    pub fn set_merge_output(&mut self, merge: Option<bool>) -> Result<&mut Self> {
        let code = match merge {
            None => -1,
            Some(true) => 1,
            Some(false) => 0,
        };
        check(unsafe { sys::rp_run_config_set_merge_output(self.ptr.as_ptr(), code) })?;
        Ok(self)
    }

    /// Number of microbatches this configuration sets (`None`: unset).
    pub fn num_microbatch(&self) -> Result<Option<i32>> {
        let mut n = 0;
        check(unsafe { sys::rp_run_config_get_num_microbatch(&mut n, self.as_ptr()) })?;
        Ok(if n == 0 { None } else { Some(n) })
    }

    /// Recompute granularity this configuration sets ([`RecomputeGrain::Default`]: unset).
    pub fn recompute_grain(&self) -> Result<RecomputeGrain> {
        let mut g = 0;
        check(unsafe { sys::rp_run_config_get_recompute_grain(&mut g, self.as_ptr()) })?;
        Ok(RecomputeGrain::from_code(g))
    }

    /// Output device this configuration sets: [`Device::CPU`] or a GPU (`None`: unset).
    pub fn output_device(&self) -> Result<Option<Device>> {
        let (mut kind, mut id) = (0, 0);
        check(unsafe { sys::rp_run_config_get_output_device(&mut kind, &mut id, self.as_ptr()) })?;
        Ok(if kind == 0 {
            None
        } else {
            Some(Device { kind, id })
        })
    }

    /// Whether outputs are merged: `Some(true)` merged, `Some(false)` one per microbatch,
    /// `None` unset.
    pub fn merge_output(&self) -> Result<Option<bool>> {
        let mut m = -1;
        check(unsafe { sys::rp_run_config_get_merge_output(&mut m, self.as_ptr()) })?;
        Ok(if m < 0 { None } else { Some(m != 0) })
    }
}

impl Drop for RunConfig {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once. A model keeps its own copy.
        unsafe { sys::rp_run_config_destroy(self.ptr.as_ptr()) }
    }
}

/// Options for [`Model::new`](crate::Model::new).
#[derive(Debug)]
pub struct ModelOptions {
    ptr: NonNull<sys::rp_model_options>,
}

// SAFETY: as for RunConfig.
unsafe impl Send for ModelOptions {}

impl ModelOptions {
    /// Options holding the defaults.
    pub fn new() -> Result<ModelOptions> {
        crate::ensure_abi()?;
        let mut p = std::ptr::null_mut();
        check(unsafe { sys::rp_model_options_create(&mut p) })?;
        NonNull::new(p)
            .map(|ptr| ModelOptions { ptr })
            .ok_or_else(|| {
                Error::new(
                    crate::Status::Internal,
                    "rp_model_options_create returned NULL",
                )
            })
    }

    pub(crate) fn as_ptr(&self) -> *const sys::rp_model_options {
        self.ptr.as_ptr()
    }

    /// Data type of the weights the devices compute with (default f32).
    pub fn set_model_dtype(&mut self, dtype: FloatType) -> Result<&mut Self> {
        check(unsafe { sys::rp_model_options_set_model_dtype(self.ptr.as_ptr(), dtype.code()) })?;
        Ok(self)
    }

    /// Data type of master weights and optimizer state (default f32).
    pub fn set_optim_dtype(&mut self, dtype: FloatType) -> Result<&mut Self> {
        check(unsafe { sys::rp_model_options_set_optim_dtype(self.ptr.as_ptr(), dtype.code()) })?;
        Ok(self)
    }

    /// Host pinning of the weights.
    pub fn set_pin_mode(&mut self, mode: PinMode) -> Result<&mut Self> {
        let code = match mode {
            PinMode::Alloc => sys::RP_PIN_ALLOC,
            PinMode::Register => sys::RP_PIN_REGISTER,
            PinMode::Off => sys::RP_PIN_OFF,
        };
        check(unsafe { sys::rp_model_options_set_pin_mode(self.ptr.as_ptr(), code) })?;
        Ok(self)
    }

    /// Host memory layout of the per-parameter state (default [`HostMemoryMode::Standard`]).
    pub fn set_host_memory_mode(&mut self, mode: HostMemoryMode) -> Result<&mut Self> {
        check(unsafe {
            sys::rp_model_options_set_host_memory_mode(self.ptr.as_ptr(), mode.code())
        })?;
        Ok(self)
    }

    /// The model-level run configuration (copied; `None` clears it).
    pub fn set_run_config(&mut self, config: Option<&RunConfig>) -> Result<&mut Self> {
        let p = config.map_or(std::ptr::null(), |c| c.as_ptr());
        check(unsafe { sys::rp_model_options_set_run_config(self.ptr.as_ptr(), p) })?;
        Ok(self)
    }

    /// Seed of weight initialisation and dropout (default 0).
    pub fn set_seed(&mut self, seed: u64) -> Result<&mut Self> {
        check(unsafe { sys::rp_model_options_set_seed(self.ptr.as_ptr(), seed) })?;
        Ok(self)
    }

    /// Name shown in logs.
    pub fn set_name(&mut self, name: &str) -> Result<&mut Self> {
        let c = CString::new(name).map_err(|_| Error::invalid("name contains a NUL byte"))?;
        check(unsafe { sys::rp_model_options_set_name(self.ptr.as_ptr(), c.as_ptr()) })?;
        Ok(self)
    }

    /// Data parallelism across processes (`rp_model_options_set_data_parallel`,
    /// docs/several-machines.md): this process is rank `rank` of `world_size`, each running its
    /// own model on its share of every batch; the ranks' gradients are averaged before every
    /// optimizer step. [`Model::new`](crate::Model::new) joins the group (blocking until every
    /// rank has); before the first training call every rank takes rank 0's weights.
    ///
    /// `rank`: 0 .. world_size - 1, or -1: `$RANK`. `world_size`: >= 1, -1: `$WORLD_SIZE`, 0:
    /// off (the default). `rendezvous`: `"env://"` (`$MASTER_ADDR` and `$MASTER_PORT`, as
    /// torchrun sets them; `None` means this) or `"tcp://host:port"` (rank 0 hosts the store).
    /// `timeout`: how long a rank waits for the others, at creation and in every collective
    /// (rounded up to whole milliseconds; zero: 10 minutes). A rank that dies or times out
    /// makes the others' calls fail with [`Status::Io`](crate::Status::Io) (CPU devices and
    /// GPUs), afterwards [`Status::State`](crate::Status::State): create the model again on
    /// every rank.
    /// Errors: [`Status::InvalidArgument`](crate::Status::InvalidArgument) for values out of
    /// range (the environment and the address are checked by `Model::new`).
    pub fn set_data_parallel(
        &mut self,
        rank: i32,
        world_size: i32,
        rendezvous: Option<&str>,
        timeout: Duration,
    ) -> Result<&mut Self> {
        let rendezvous = rendezvous
            .map(|r| CString::new(r).map_err(|_| Error::invalid("rendezvous contains a NUL byte")))
            .transpose()?;
        let p = rendezvous.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        let nanos = timeout.as_nanos();
        let millis = i64::try_from((nanos + 999_999) / 1_000_000).unwrap_or(i64::MAX);
        check(unsafe {
            sys::rp_model_options_set_data_parallel(self.ptr.as_ptr(), rank, world_size, p, millis)
        })?;
        Ok(self)
    }

    /// Data parallel only: report each training call's loss as the mean over the ranks (one
    /// more small collective per call); `false` (default): this rank's own loss.
    pub fn set_global_loss(&mut self, global: bool) -> Result<&mut Self> {
        check(unsafe { sys::rp_model_options_set_global_loss(self.ptr.as_ptr(), global as i32) })?;
        Ok(self)
    }

    /// LoRA adapters (PEFT's LoraConfig) on the decoder layers of a Hugging Face model
    /// ([`Model::from_hf_config`](crate::Model::from_hf_config) /
    /// [`Model::from_hf_dir`](crate::Model::from_hf_dir); a model built from a spec refuses
    /// them): each target projection gains (alpha / rank) B A with A uniform and B zero at
    /// creation; every other parameter becomes frozen (held once in the model dtype, no
    /// master, gradient or optimizer state). `target_modules`: comma-separated PEFT module
    /// names among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or
    /// "all-linear"; `None` means "q_proj,v_proj". `rank` 0 turns adapters off.
    /// Errors: [`Status::InvalidArgument`](crate::Status::InvalidArgument) naming the bad value
    /// or module.
    pub fn set_lora(
        &mut self,
        rank: i32,
        alpha: f64,
        dropout: f64,
        target_modules: Option<&str>,
    ) -> Result<&mut Self> {
        let targets = target_modules
            .map(|t| {
                CString::new(t).map_err(|_| Error::invalid("target_modules contains a NUL byte"))
            })
            .transpose()?;
        let p = targets.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        check(unsafe {
            sys::rp_model_options_set_lora(self.ptr.as_ptr(), rank, alpha, dropout, p)
        })?;
        Ok(self)
    }

    /// Device kind and count (0: all visible GPUs, or one CPU worker device).
    pub fn set_devices(&mut self, kind: DeviceKind, count: i32) -> Result<&mut Self> {
        check(unsafe { sys::rp_model_options_set_devices(self.ptr.as_ptr(), kind.code(), count) })?;
        Ok(self)
    }

    /// Explicit stage plan: stage `s` holds the next `layers_per_stage[s]` layers. An empty
    /// slice returns to the automatic planner.
    pub fn set_stage_plan(&mut self, layers_per_stage: &[i32]) -> Result<&mut Self> {
        let p = if layers_per_stage.is_empty() {
            std::ptr::null()
        } else {
            layers_per_stage.as_ptr()
        };
        check(unsafe {
            sys::rp_model_options_set_stage_plan(self.ptr.as_ptr(), p, layers_per_stage.len())
        })?;
        Ok(self)
    }
}

impl Drop for ModelOptions {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once.
        unsafe { sys::rp_model_options_destroy(self.ptr.as_ptr()) }
    }
}
