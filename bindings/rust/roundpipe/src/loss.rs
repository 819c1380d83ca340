//! Losses: built-in, or a Rust closure called through a trampoline that catches panics.

use std::os::raw::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::Mutex;

use roundpipe_sys as sys;

use crate::error::{check, Error, Result};
use crate::tensor::{Tensor, TensorView};

/// Built-in losses, computed per microbatch; `forward_backward` returns their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossKind {
    /// The model's output is the loss (a 0-d tensor).
    Output,
    /// Mean squared error against float labels of the output's shape.
    Mse,
    /// Mean cross entropy of logits [N, C] against int64 labels [N].
    CrossEntropy,
    /// Causal-LM cross entropy fused into a last `lm_head` layer (chunked, labels: token ids
    /// [batch, seq] shaped like input 0, -100 for no target); the mean over every target of
    /// the call.
    CausalLm,
}

/// What a loss closure receives for one microbatch. The views are valid during the call only.
#[derive(Debug)]
pub struct LossInput<'a> {
    /// The microbatch's outputs (fp32, host memory).
    pub outputs: TensorView<'a>,
    /// The microbatch's labels, when the call has labels.
    pub labels: Option<TensorView<'a>>,
    /// Index of the microbatch.
    pub microbatch: i32,
}

/// A loss closure: returns the loss value of the microbatch and d(loss)/d(outputs) (same shape
/// as the outputs, any float dtype, host memory), or a message saying why it failed.
pub type LossFn = dyn FnMut(LossInput<'_>) -> std::result::Result<(f64, Tensor), String> + Send;

pub(crate) struct LossState {
    f: Mutex<Box<LossFn>>,
    last_error: Mutex<Option<String>>,
}

impl LossState {
    pub(crate) fn take_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn set_error(&self, msg: String) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
    }
}

/// A loss: built-in or a closure, times a scale factor.
pub struct Loss {
    ptr: NonNull<sys::rp_loss>,
    // The closure's state: its address is the callback's user_data, so it is boxed and lives
    // as long as the loss handle.
    state: Option<Box<LossState>>,
}

// SAFETY: the handle is owned by this value; the closure is Send and behind a Mutex. Not Sync:
// the header promises no locking for a loss shared between threads.
unsafe impl Send for Loss {}

impl std::fmt::Debug for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loss")
            .field("callback", &self.state.is_some())
            .finish()
    }
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

unsafe extern "C" fn loss_trampoline(
    out_loss: *mut f64,
    out_grad: *mut *mut sys::DLManagedTensor,
    outputs: *const sys::DLManagedTensor,
    labels: *const sys::DLManagedTensor,
    microbatch: i32,
    user_data: *mut c_void,
) -> i32 {
    if user_data.is_null() || out_loss.is_null() || out_grad.is_null() || outputs.is_null() {
        return 1;
    }
    // SAFETY: user_data is the LossState boxed by Loss::from_fn, alive while the loss is.
    let state = &*(user_data as *const LossState);
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the library lends these for the duration of the callback.
        let input = LossInput {
            outputs: TensorView::from_raw(&(*outputs).dl_tensor),
            labels: if labels.is_null() {
                None
            } else {
                Some(TensorView::from_raw(&(*labels).dl_tensor))
            },
            microbatch,
        };
        let mut f = state.f.lock().unwrap_or_else(|e| e.into_inner());
        (f)(input)
    }));
    match result {
        Ok(Ok((value, grad))) => {
            *out_loss = value;
            *out_grad = grad.into_managed();
            0
        }
        Ok(Err(msg)) => {
            state.set_error(format!(
                "loss callback failed on microbatch {}: {}",
                microbatch, msg
            ));
            1
        }
        Err(p) => {
            state.set_error(format!(
                "loss callback panicked on microbatch {}: {}",
                microbatch,
                panic_message(&*p)
            ));
            1
        }
    }
}

impl Loss {
    /// A built-in loss.
    pub fn new(kind: LossKind) -> Result<Loss> {
        crate::ensure_abi()?;
        let code = match kind {
            LossKind::Output => sys::RP_LOSS_OUTPUT,
            LossKind::Mse => sys::RP_LOSS_MSE,
            LossKind::CrossEntropy => sys::RP_LOSS_CROSS_ENTROPY,
            LossKind::CausalLm => sys::RP_LOSS_CAUSAL_LM,
        };
        let mut p = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer.
        check(unsafe { sys::rp_loss_create(&mut p, code) })?;
        let ptr = NonNull::new(p)
            .ok_or_else(|| Error::new(crate::Status::Internal, "rp_loss_create returned NULL"))?;
        Ok(Loss { ptr, state: None })
    }

    /// A loss computed by `f`, called on a device worker thread once per microbatch (never
    /// concurrently for one model). An `Err` or a panic fails the call with
    /// [`Status::Callback`](crate::Status::Callback), whose message includes yours.
    pub fn from_fn<F>(f: F) -> Result<Loss>
    where
        F: FnMut(LossInput<'_>) -> std::result::Result<(f64, Tensor), String> + Send + 'static,
    {
        crate::ensure_abi()?;
        let state = Box::new(LossState {
            f: Mutex::new(Box::new(f)),
            last_error: Mutex::new(None),
        });
        let user_data = &*state as *const LossState as *mut c_void;
        let mut p = std::ptr::null_mut();
        // SAFETY: the trampoline matches rp_loss_fn; user_data outlives the handle (both are
        // owned by the Loss, and the handle is destroyed first in Drop).
        check(unsafe { sys::rp_loss_create_callback(&mut p, Some(loss_trampoline), user_data) })?;
        let ptr = NonNull::new(p).ok_or_else(|| {
            Error::new(
                crate::Status::Internal,
                "rp_loss_create_callback returned NULL",
            )
        })?;
        Ok(Loss {
            ptr,
            state: Some(state),
        })
    }

    /// Multiply the loss and its gradient by `scale` (e.g. 1/num_microbatch for a batch mean).
    pub fn set_scale(&mut self, scale: f64) -> Result<&mut Self> {
        check(unsafe { sys::rp_loss_set_scale(self.ptr.as_ptr(), scale) })?;
        Ok(self)
    }

    /// Builder form of [`set_scale`](Self::set_scale).
    pub fn with_scale(mut self, scale: f64) -> Result<Loss> {
        self.set_scale(scale)?;
        Ok(self)
    }

    pub(crate) fn as_ptr(&self) -> *const sys::rp_loss {
        self.ptr.as_ptr()
    }

    pub(crate) fn state(&self) -> Option<&LossState> {
        self.state.as_deref()
    }
}

impl Drop for Loss {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once, before the closure state it points to.
        unsafe { sys::rp_loss_destroy(self.ptr.as_ptr()) }
    }
}
