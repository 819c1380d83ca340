//! Safe Rust API of RoundPipe: train models larger than GPU memory with a round-robin pipeline
//! of layer stages, fused forward + backward and an asynchronous CPU optimizer.
//!
//! ```no_run
//! use roundpipe::{DeviceKind, Loss, LossKind, Model, ModelOptions, Optimizer, RunConfig, Tensor};
//!
//! # fn main() -> roundpipe::Result<()> {
//! let mut config = RunConfig::new()?;
//! config.set_num_microbatch(3)?;
//! let mut options = ModelOptions::new()?;
//! options.set_seed(42)?.set_devices(DeviceKind::Cpu, 2)?.set_run_config(Some(&config))?;
//! let mut model = Model::new(
//!     r#"{"layers":[{"type":"linear","in":8,"out":1}]}"#,
//!     Some(&options),
//! )?;
//!
//! let x = Tensor::new(&[0.5f32; 24 * 8], &[24, 8])?;
//! let y = Tensor::new(&[1.0f32; 24], &[24, 1])?;
//! let loss = Loss::new(LossKind::Mse)?.with_scale(1.0 / 3.0)?;
//! let adamw = Optimizer::adamw(1e-2)?;
//! for _ in 0..10 {
//!     let value = model.forward_backward(&[&x], Some(&y), Some(&loss), None)?;
//!     model.step(&adamw, true)?;
//!     println!("loss {}", value);
//! }
//! model.synchronize()?;
//! # Ok(())
//! # }
//! ```
//!
//! Every call returns `Result<_, Error>`; an [`Error`] carries the library's status code and
//! message. Handles free themselves on drop. [`Model`] and the other handles are `Send` but not
//! `Sync`: the C API lets one thread at a time drive a model. The raw declarations are in the
//! `roundpipe-sys` crate (re-exported as [`sys`]).
//!
//! A model cannot be shared between threads (this does not compile):
//! ```compile_fail
//! fn is_sync<T: Sync>() {}
//! is_sync::<roundpipe::Model>();
//! ```

mod config;
mod error;
mod installed;
mod layer;
mod log;
mod loss;
mod model;
mod optim;
mod progress;
mod tensor;
mod tensor_list;

use std::sync::Mutex;

pub use roundpipe_sys as sys;

pub use config::{
    DeviceKind, FloatType, HostMemoryMode, ModelOptions, PinMode, RecomputeGrain, RunConfig, Split,
};
pub use error::{Error, Result, Status};
pub use layer::{Context, LayerCall, LayerDef, LayerGrads, LayerOutput, ParamKind, Phase};
pub use log::{reset_log_callback, set_log_callback, LogLevel};
pub use loss::{Loss, LossFn, LossInput, LossKind};
pub use model::{HostStateBytes, LoraConfig, Model, StepContext};
pub use optim::{adam_apply, AdamEntry, AdamHyper, Optimizer, OptimizerKind};
pub use progress::{reset_progress_callback, set_progress_callback};
pub use tensor::{AsDlpack, DType, Device, DlTensor, Element, Tensor, TensorView};
pub use tensor_list::split_microbatches;

/// Version of the loaded library, "MAJOR.MINOR.PATCH".
pub fn version() -> String {
    // SAFETY: static storage.
    unsafe { error::c_string(sys::rp_version()) }
}

/// ABI version of the loaded library.
pub fn abi_version() -> i32 {
    // SAFETY: no arguments, cannot fail.
    unsafe { sys::rp_abi_version() }
}

/// Version of the libtorch the loaded library was built against, "MAJOR.MINOR.PATCH"; the
/// library's run path finds that torch.
pub fn torch_version() -> String {
    // SAFETY: static storage.
    unsafe { error::c_string(sys::rp_torch_version()) }
}

/// The ABI version this crate was written for.
pub const ABI_VERSION: i32 = sys::RP_ABI_VERSION;

/// Refuse to run against a library of another ABI version (checked once, by every constructor).
pub(crate) fn ensure_abi() -> Result<()> {
    // A Mutex rather than OnceLock: Rust 1.63 (Debian 12's) has const Mutex::new, not OnceLock.
    static CHECKED: Mutex<Option<Result<()>>> = Mutex::new(None);
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    checked
        .get_or_insert_with(|| {
            let found = abi_version();
            if found == ABI_VERSION {
                Ok(())
            } else {
                Err(Error::new(
                    Status::State,
                    format!(
                        "libroundpipe has ABI version {}, this crate was written for {}; rebuild \
                         against the matching library",
                        found, ABI_VERSION
                    ),
                ))
            }
        })
        .clone()
}

/// Whether the loaded library can do data parallelism across processes (it was built with
/// c10d's Gloo support; `rp_data_parallel_available`), see
/// [`ModelOptions::set_data_parallel`].
pub fn data_parallel_available() -> Result<bool> {
    let mut available = 0;
    error::check(unsafe { sys::rp_data_parallel_available(&mut available) })?;
    Ok(available != 0)
}

/// Number of CUDA GPUs visible to this process (0 without a GPU or a CUDA build).
pub fn cuda_device_count() -> Result<i32> {
    let mut n = 0;
    error::check(unsafe { sys::rp_cuda_device_count(&mut n) })?;
    Ok(n)
}
