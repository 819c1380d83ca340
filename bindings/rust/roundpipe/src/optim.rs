//! Built-in optimizer settings (the state lives in the model).

use std::ptr::NonNull;

use roundpipe_sys as sys;

use crate::error::{check, Error, Result};

/// Built-in optimizers; both run on the CPU over fp32 master weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// `torch.optim.AdamW`; defaults lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2.
    AdamW,
    /// `torch.optim.SGD` (dampening 0, no Nesterov); defaults lr 1e-3, momentum 0, decay 0.
    Sgd,
}

/// Hyperparameters of a built-in optimizer, copied by each [`Model::step`](crate::Model::step).
#[derive(Debug)]
pub struct Optimizer {
    ptr: NonNull<sys::rp_optimizer>,
    kind: OptimizerKind,
}

// SAFETY: plain settings owned by this value; Send, not Sync (the header promises no locking).
unsafe impl Send for Optimizer {}

impl Optimizer {
    /// Settings with PyTorch's defaults for `kind`.
    pub fn new(kind: OptimizerKind) -> Result<Optimizer> {
        crate::ensure_abi()?;
        let code = match kind {
            OptimizerKind::AdamW => sys::RP_OPTIMIZER_ADAMW,
            OptimizerKind::Sgd => sys::RP_OPTIMIZER_SGD,
        };
        let mut p = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer.
        check(unsafe { sys::rp_optimizer_create(&mut p, code) })?;
        NonNull::new(p)
            .map(|ptr| Optimizer { ptr, kind })
            .ok_or_else(|| Error::new(crate::Status::Internal, "rp_optimizer_create returned NULL"))
    }

    /// AdamW settings with learning rate `lr`.
    pub fn adamw(lr: f64) -> Result<Optimizer> {
        let mut o = Optimizer::new(OptimizerKind::AdamW)?;
        o.set_learning_rate(lr)?;
        Ok(o)
    }

    /// SGD settings with learning rate `lr`.
    pub fn sgd(lr: f64) -> Result<Optimizer> {
        let mut o = Optimizer::new(OptimizerKind::Sgd)?;
        o.set_learning_rate(lr)?;
        Ok(o)
    }

    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }

    pub(crate) fn as_ptr(&self) -> *const sys::rp_optimizer {
        self.ptr.as_ptr()
    }

    /// Learning rate (finite, >= 0); takes effect at the next step.
    pub fn set_learning_rate(&mut self, lr: f64) -> Result<&mut Self> {
        check(unsafe { sys::rp_optimizer_set_learning_rate(self.ptr.as_ptr(), lr) })?;
        Ok(self)
    }

    /// AdamW betas, each in [0, 1).
    pub fn set_betas(&mut self, beta1: f64, beta2: f64) -> Result<&mut Self> {
        check(unsafe { sys::rp_optimizer_set_betas(self.ptr.as_ptr(), beta1, beta2) })?;
        Ok(self)
    }

    /// AdamW epsilon (> 0).
    pub fn set_eps(&mut self, eps: f64) -> Result<&mut Self> {
        check(unsafe { sys::rp_optimizer_set_eps(self.ptr.as_ptr(), eps) })?;
        Ok(self)
    }

    /// Weight decay: decoupled for AdamW, added to the gradient for SGD.
    pub fn set_weight_decay(&mut self, weight_decay: f64) -> Result<&mut Self> {
        check(unsafe { sys::rp_optimizer_set_weight_decay(self.ptr.as_ptr(), weight_decay) })?;
        Ok(self)
    }

    /// SGD momentum in [0, 1).
    pub fn set_momentum(&mut self, momentum: f64) -> Result<&mut Self> {
        check(unsafe { sys::rp_optimizer_set_momentum(self.ptr.as_ptr(), momentum) })?;
        Ok(self)
    }
}

impl Drop for Optimizer {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once.
        unsafe { sys::rp_optimizer_destroy(self.ptr.as_ptr()) }
    }
}
