//! Built-in optimizer settings (the state lives in the model).

use std::ptr::NonNull;

use roundpipe_sys as sys;

use crate::error::{check, Error, Result};
use crate::tensor::{borrowed_managed, AsDlpack, Tensor};

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

/// Hyperparameters of [`adam_apply`], as `torch.optim.Adam`'s (the defaults are its defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// `true`: AdamW's decoupled weight decay; `false`: L2 (added to what the moments see).
    pub decoupled_weight_decay: bool,
}

impl Default for AdamHyper {
    fn default() -> AdamHyper {
        AdamHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: false,
        }
    }
}

/// One parameter of [`adam_apply`]: the weight and both moments (float32, the weight's shape)
/// are updated in place; `step` is the 1-based number of this update.
#[derive(Debug)]
pub struct AdamEntry<'a> {
    pub param: &'a mut Tensor,
    pub grad: &'a Tensor,
    pub exp_avg: &'a mut Tensor,
    pub exp_avg_sq: &'a mut Tensor,
    pub step: i64,
}

/// One Adam update of tensors you own, with the engine's kernel (`rp_adam_apply`): what
/// `torch.optim.Adam` computes for each entry at its step. Every entry is checked first; on
/// error no tensor has changed.
pub fn adam_apply(entries: &mut [AdamEntry<'_>], hyper: &AdamHyper) -> Result<()> {
    crate::ensure_abi()?;
    let mut params = Vec::with_capacity(entries.len());
    let mut exp_avgs = Vec::with_capacity(entries.len());
    let mut exp_avg_sqs = Vec::with_capacity(entries.len());
    let mut steps = Vec::with_capacity(entries.len());
    for e in entries.iter_mut() {
        params.push(e.param.borrowed_mut());
        exp_avgs.push(e.exp_avg.borrowed_mut());
        exp_avg_sqs.push(e.exp_avg_sq.borrowed_mut());
        steps.push(e.step);
    }
    let grads_in: Vec<&dyn AsDlpack> = entries.iter().map(|e| e.grad as &dyn AsDlpack).collect();
    let grads = borrowed_managed(&grads_in);
    let mut_ptrs = |v: &mut Vec<sys::DLManagedTensor>| -> Vec<*mut sys::DLManagedTensor> {
        v.iter_mut().map(|m| m as *mut _).collect()
    };
    let p = mut_ptrs(&mut params);
    let m = mut_ptrs(&mut exp_avgs);
    let v = mut_ptrs(&mut exp_avg_sqs);
    let g: Vec<*const sys::DLManagedTensor> = grads.iter().map(|t| t as *const _).collect();
    // SAFETY: every struct and the memory it describes is borrowed (the written ones mutably)
    // for the duration of the call; the arrays hold entries.len() pointers each.
    check(unsafe {
        sys::rp_adam_apply(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            steps.as_ptr(),
            steps.len(),
            hyper.lr,
            hyper.beta1,
            hyper.beta2,
            hyper.eps,
            hyper.weight_decay,
            hyper.decoupled_weight_decay as i32,
        )
    })
}
