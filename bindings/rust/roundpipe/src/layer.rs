//! Caller-defined layers: a layer whose forward and backward are Rust closures, mixed with
//! built-in layers in one model ([`Model::with_layers`](crate::Model::with_layers)).
//!
//! RoundPipe owns the layer's parameters and buffers as it owns a built-in layer's (master
//! weights, gradients, optimizer state, save and load) and lends them to the closures for each
//! call through [`LayerCall`]. The forward closure returns the outputs and, in the phases with
//! gradient ([`Phase::Recompute`], [`Phase::Tail`]), a context: anything the backward closure
//! needs, given back to it by reference and dropped by the engine's release once backward has
//! run or the call has failed.
//!
//! ```no_run
//! # fn main() -> roundpipe::Result<()> {
//! use roundpipe::{Context, LayerCall, LayerDef, LayerGrads, LayerOutput, Model, Phase, Tensor, TensorView};
//!
//! // y = x * w, one trainable weight per feature (4 features)
//! let mut scale = LayerDef::new(
//!     "rust:scale",
//!     |call: &mut LayerCall<'_>, inputs: &[TensorView<'_>]| {
//!         let e = |e: roundpipe::Error| e.to_string();
//!         let x = inputs[0].as_slice::<f32>().map_err(e)?;
//!         let w = call.params()[0].to_vec::<f32>().map_err(e)?;
//!         let y: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * w[i % 4]).collect();
//!         let out = LayerOutput::new(vec![Tensor::new(&y, inputs[0].shape()).map_err(e)?]);
//!         // keep what backward needs only when a gradient is wanted
//!         Ok(if call.phase() == Phase::Forward { out } else { out.with_context((x.to_vec(), w)) })
//!     },
//!     Some(|_call: &mut LayerCall<'_>, ctx: &mut Context, grads: &[Option<TensorView<'_>>]| {
//!         let (x, w) = ctx.downcast_ref::<(Vec<f32>, Vec<f32>)>().unwrap();
//!         let g = grads[0].as_ref().unwrap();
//!         let gv = g.as_slice::<f32>().map_err(|e| e.to_string())?;
//!         let dx: Vec<f32> = gv.iter().enumerate().map(|(i, v)| v * w[i % 4]).collect();
//!         let mut dw = vec![0f32; 4];
//!         for i in 0..gv.len() { dw[i % 4] += gv[i] * x[i]; }
//!         let t = |v: &[f32], s: &[i64]| Tensor::new(v, s).map_err(|e| e.to_string());
//!         // one entry per input, one per parameter (None for a frozen one)
//!         Ok(LayerGrads { inputs: vec![Some(t(&dx, g.shape())?)], params: vec![Some(t(&dw, &[4])?)] })
//!     }),
//! )?;
//! scale.add_param("w", &Tensor::new(&[1f32; 4], &[4])?, true)?; // false: frozen
//! let spec = r#"{"layers": [{"type": "caller", "def": 0}, {"type": "linear", "in": 4, "out": 1}]}"#;
//! let mut options = roundpipe::ModelOptions::new()?;
//! options.set_devices(roundpipe::DeviceKind::Cpu, 2)?.set_stage_plan(&[1, 1])?;
//! let model = Model::with_layers(spec, vec![scale], Some(&options))?;
//! # drop(model);
//! # Ok(())
//! # }
//! ```

use std::any::Any;
use std::ffi::CString;
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::slice;
use std::sync::{Arc, Mutex};

use roundpipe_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::loss::panic_message;
use crate::tensor::{borrowed_managed, AsDlpack, Device, Element, Tensor, TensorView};

/// What a forward closure is asked to do (`rp_layer_phase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A forward stage: no gradient wanted, no context kept. Buffers may be updated.
    Forward,
    /// The recompute of a backward stage: keep a context for backward. The seed equals the
    /// forward's. Buffers must not change.
    Recompute,
    /// The fused tail stage: forward with gradient (keep a context), then backward. Buffers may
    /// be updated.
    Tail,
}

impl Phase {
    fn from_code(code: i32) -> Option<Phase> {
        match code {
            sys::RP_PHASE_FORWARD => Some(Phase::Forward),
            sys::RP_PHASE_RECOMPUTE => Some(Phase::Recompute),
            sys::RP_PHASE_TAIL => Some(Phase::Tail),
            _ => None,
        }
    }
}

/// What a parameter of the model is (`rp_param_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// Gets gradients and optimizer updates (every built-in layer's parameters).
    Trainable,
    /// A caller layer's frozen parameter: no gradient, no optimizer state, no update.
    Frozen,
    /// A caller layer's buffer (running statistics, counters).
    Buffer,
}

impl ParamKind {
    pub(crate) fn from_code(code: i32) -> Result<ParamKind> {
        match code {
            sys::RP_PARAM_TRAINABLE => Ok(ParamKind::Trainable),
            sys::RP_PARAM_FROZEN => Ok(ParamKind::Frozen),
            sys::RP_PARAM_BUFFER => Ok(ParamKind::Buffer),
            other => Err(Error::new(
                Status::Internal,
                format!("unknown parameter kind {}", other),
            )),
        }
    }
}

/// The context a forward closure keeps for its backward: any value, downcast in backward.
pub type Context = dyn Any + Send;

/// What a forward closure returns: its outputs (at least one) and, in [`Phase::Recompute`] and
/// [`Phase::Tail`], the context for backward (ignored, and dropped at once, in
/// [`Phase::Forward`]).
pub struct LayerOutput {
    pub outputs: Vec<Tensor>,
    pub context: Option<Box<Context>>,
}

impl LayerOutput {
    /// Outputs without a context.
    pub fn new(outputs: Vec<Tensor>) -> LayerOutput {
        LayerOutput {
            outputs,
            context: None,
        }
    }

    /// The same outputs, keeping `context` for backward.
    pub fn with_context<C: Any + Send>(mut self, context: C) -> LayerOutput {
        self.context = Some(Box::new(context));
        self
    }
}

/// What a backward closure returns: one entry per input (its gradient, of the input's shape,
/// or `None` where the input needs none) and one per parameter in declaration order (`None`
/// for a frozen parameter). RoundPipe accumulates the parameter gradients.
#[derive(Default)]
pub struct LayerGrads {
    pub inputs: Vec<Option<Tensor>>,
    pub params: Vec<Option<Tensor>>,
}

/// What one callback invocation is lent: device, phase, seed, microbatch, parameters and
/// buffers. Valid during the closure only.
pub struct LayerCall<'a> {
    raw: *const sys::rp_layer_call,
    phase: Phase,
    device: Device,
    seed: u64,
    microbatch: i32,
    training: bool,
    _life: PhantomData<&'a ()>,
}

impl<'a> LayerCall<'a> {
    /// # Safety
    /// `raw` must be the call the library lent to the running callback.
    unsafe fn new(raw: *const sys::rp_layer_call) -> Result<LayerCall<'a>> {
        let (mut phase, mut kind, mut id, mut mb, mut training) = (0i32, 0i32, 0i32, 0i32, 0i32);
        let mut seed = 0u64;
        check(sys::rp_layer_call_info(
            &mut phase,
            &mut kind,
            &mut id,
            ptr::null_mut(),
            &mut seed,
            &mut mb,
            &mut training,
            raw,
        ))?;
        let phase = Phase::from_code(phase)
            .ok_or_else(|| Error::new(Status::Internal, format!("unknown phase {}", phase)))?;
        Ok(LayerCall {
            raw,
            phase,
            device: Device { kind, id },
            seed,
            microbatch: mb,
            training: training != 0,
            _life: PhantomData,
        })
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The device the layer runs on (`kDLCPU` for CPU worker devices).
    pub fn device(&self) -> Device {
        self.device
    }

    /// The same in a forward and its recompute (use it for dropout masks).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Index of the microbatch in the call.
    pub fn microbatch(&self) -> i32 {
        self.microbatch
    }

    /// Whether the call is a training call (`forward_backward`), not `forward`.
    pub fn training(&self) -> bool {
        self.training
    }

    /// The CUDA stream to launch work on (null on CPU devices).
    pub fn stream(&self) -> *mut c_void {
        let mut stream = ptr::null_mut();
        // SAFETY: the call is valid during the callback; the other outputs are not wanted.
        let status = unsafe {
            sys::rp_layer_call_info(
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
                &mut stream,
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
                self.raw,
            )
        };
        if status == sys::RP_OK {
            stream
        } else {
            ptr::null_mut()
        }
    }

    fn tensors(&self, buffers: bool) -> &'a [*const sys::DLManagedTensor] {
        let (mut p, mut np, mut b, mut nb) = (ptr::null(), 0usize, ptr::null(), 0usize);
        // SAFETY: the call is valid during the callback; the arrays are lent until it returns.
        let status =
            unsafe { sys::rp_layer_call_tensors(&mut p, &mut np, &mut b, &mut nb, self.raw) };
        let (arr, n) = if buffers { (b, nb) } else { (p, np) };
        if status != sys::RP_OK || arr.is_null() || n == 0 {
            return &[];
        }
        // SAFETY: `n` pointers lent for the callback.
        unsafe { slice::from_raw_parts(arr, n) }
    }

    /// The layer's parameters on the device, in declaration order, in their held dtype.
    pub fn params(&self) -> Vec<TensorView<'a>> {
        self.tensors(false)
            .iter()
            // SAFETY: lent for the callback.
            .map(|&t| unsafe { TensorView::from_raw(&(*t).dl_tensor) })
            .collect()
    }

    /// The layer's buffers, in declaration order.
    pub fn buffers(&self) -> Vec<TensorView<'a>> {
        self.tensors(true)
            .iter()
            // SAFETY: lent for the callback.
            .map(|&t| unsafe { TensorView::from_raw(&(*t).dl_tensor) })
            .collect()
    }

    /// Buffer `index`'s elements, writable (host memory, type `T`). Refused in
    /// [`Phase::Recompute`], where buffers must not change.
    pub fn buffer_mut<T: Element>(&mut self, index: usize) -> Result<&mut [T]> {
        if self.phase == Phase::Recompute {
            return Err(Error::new(
                Status::State,
                "buffers must not change in the recompute phase",
            ));
        }
        let t = *self
            .tensors(true)
            .get(index)
            .ok_or_else(|| Error::invalid(format!("no buffer {}", index)))?;
        // SAFETY: lent for the callback; &mut self makes this the only view handed out now.
        let view = unsafe { TensorView::from_raw(&(*t).dl_tensor) };
        let p = view.data_ptr::<T>()?;
        let n = view.numel();
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: checked type, host memory, layout and alignment by data_ptr.
        Ok(unsafe { slice::from_raw_parts_mut(p, n) })
    }
}

type ForwardFn = dyn FnMut(&mut LayerCall<'_>, &[TensorView<'_>]) -> std::result::Result<LayerOutput, String>
    + Send;
type BackwardFn = dyn FnMut(
        &mut LayerCall<'_>,
        &mut Context,
        &[Option<TensorView<'_>>],
    ) -> std::result::Result<LayerGrads, String>
    + Send;

/// The closures of a layer and the last message one of them failed with. Its address is the
/// callbacks' user_data; models built from the layer keep it alive.
pub(crate) struct LayerState {
    name: String,
    forward: Mutex<Box<ForwardFn>>,
    backward: Option<Mutex<Box<BackwardFn>>>,
    last_error: Mutex<Option<String>>,
}

impl LayerState {
    pub(crate) fn take_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn set_error(&self, msg: String) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(format!("{}: {}", self.name, msg));
    }
}

/// Run `f`, turning an `Err` or a panic into a nonzero status and a kept message.
fn guarded(
    state: &LayerState,
    what: &str,
    f: impl FnOnce() -> std::result::Result<(), String>,
) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(msg)) => {
            state.set_error(format!("{} failed: {}", what, msg));
            1
        }
        Err(p) => {
            state.set_error(format!("{} panicked: {}", what, panic_message(&*p)));
            1
        }
    }
}

/// Append `t` (or "no tensor") to a list the library gave the callback; it owns it from now on.
unsafe fn push(
    list: *mut sys::rp_tensor_list,
    t: Option<Tensor>,
) -> std::result::Result<(), String> {
    let p = t.map_or(ptr::null_mut(), |t| t.into_managed());
    check(sys::rp_tensor_list_push(list, p)).map_err(|e| e.to_string())
}

unsafe extern "C" fn forward_trampoline(
    out_outputs: *mut sys::rp_tensor_list,
    inout_context: *mut *mut c_void,
    call: *const sys::rp_layer_call,
    inputs: *const *const sys::DLManagedTensor,
    n_inputs: usize,
    user_data: *mut c_void,
) -> i32 {
    if user_data.is_null() || out_outputs.is_null() || call.is_null() {
        return 1;
    }
    // SAFETY: user_data is the LayerState the model keeps alive.
    let state = &*(user_data as *const LayerState);
    guarded(state, "forward", || {
        let mut call = LayerCall::new(call).map_err(|e| e.to_string())?;
        let views: Vec<TensorView<'_>> = (0..n_inputs)
            .map(|i| TensorView::from_raw(&(**inputs.add(i)).dl_tensor))
            .collect();
        let result = {
            let mut f = state.forward.lock().unwrap_or_else(|e| e.into_inner());
            (f)(&mut call, &views)?
        };
        for t in result.outputs {
            push(out_outputs, Some(t))?;
        }
        // Only the phases with gradient keep a context (the engine releases those); a context
        // returned in Phase::Forward is simply dropped here.
        if let Some(context) = result.context {
            if call.phase() != Phase::Forward && !inout_context.is_null() {
                *inout_context = Box::into_raw(Box::new(context)) as *mut c_void;
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn backward_trampoline(
    out_input_grads: *mut sys::rp_tensor_list,
    out_param_grads: *mut sys::rp_tensor_list,
    context: *mut c_void,
    call: *const sys::rp_layer_call,
    output_grads: *const *const sys::DLManagedTensor,
    n_outputs: usize,
    user_data: *mut c_void,
) -> i32 {
    if user_data.is_null() || call.is_null() {
        return 1;
    }
    // SAFETY: as in forward_trampoline.
    let state = &*(user_data as *const LayerState);
    guarded(state, "backward", || {
        let backward = state
            .backward
            .as_ref()
            .ok_or_else(|| "the layer has no backward".to_string())?;
        if context.is_null() {
            return Err("backward without the forward's context".to_string());
        }
        // SAFETY: the context forward_trampoline stored; released only after this returns.
        let ctx: &mut Box<Context> = &mut *(context as *mut Box<Context>);
        let mut call = LayerCall::new(call).map_err(|e| e.to_string())?;
        let grads: Vec<Option<TensorView<'_>>> = (0..n_outputs)
            .map(|i| {
                let p = *output_grads.add(i);
                if p.is_null() {
                    None
                } else {
                    Some(TensorView::from_raw(&(*p).dl_tensor))
                }
            })
            .collect();
        let result = {
            let mut f = backward.lock().unwrap_or_else(|e| e.into_inner());
            (f)(&mut call, &mut **ctx, &grads)?
        };
        for t in result.inputs {
            push(out_input_grads, t)?;
        }
        for t in result.params {
            push(out_param_grads, t)?;
        }
        Ok(())
    })
}

unsafe extern "C" fn release_trampoline(context: *mut c_void, _user_data: *mut c_void) {
    if !context.is_null() {
        // SAFETY: a context forward_trampoline stored; the engine releases each once. A panic
        // in the context's Drop must not cross into C.
        let boxed = Box::from_raw(context as *mut Box<Context>);
        let _ = catch_unwind(AssertUnwindSafe(move || drop(boxed)));
    }
}

/// A caller-defined layer's declaration: its closures, parameters and buffers. Give it to
/// [`Model::with_layers`](crate::Model::with_layers).
pub struct LayerDef {
    ptr: NonNull<sys::rp_layer_def>,
    state: Arc<LayerState>,
}

// SAFETY: the handle is owned by this value; the closures are Send and behind Mutexes.
unsafe impl Send for LayerDef {}

impl std::fmt::Debug for LayerDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerDef")
            .field("type_name", &self.state.name)
            .finish()
    }
}

impl LayerDef {
    /// A layer named `type_name` (it names the layer in messages) computed by `forward` and,
    /// for a layer that passes gradients, `backward`. Both run on device worker threads; an
    /// `Err` or a panic fails the call with [`Status::Callback`], and the error message of the
    /// model call includes yours.
    pub fn new<F, B>(type_name: &str, forward: F, backward: Option<B>) -> Result<LayerDef>
    where
        F: FnMut(&mut LayerCall<'_>, &[TensorView<'_>]) -> std::result::Result<LayerOutput, String>
            + Send
            + 'static,
        B: FnMut(
                &mut LayerCall<'_>,
                &mut Context,
                &[Option<TensorView<'_>>],
            ) -> std::result::Result<LayerGrads, String>
            + Send
            + 'static,
    {
        crate::ensure_abi()?;
        let name =
            CString::new(type_name).map_err(|_| Error::invalid("name contains a NUL byte"))?;
        let has_backward = backward.is_some();
        let state = Arc::new(LayerState {
            name: type_name.to_string(),
            forward: Mutex::new(Box::new(forward)),
            backward: backward.map(|b| Mutex::new(Box::new(b) as Box<BackwardFn>)),
            last_error: Mutex::new(None),
        });
        let user_data = Arc::as_ptr(&state) as *mut c_void;
        let mut p = ptr::null_mut();
        // SAFETY: the trampolines match the callback types; user_data lives in `state`, which
        // every model built from this def keeps.
        check(unsafe {
            sys::rp_layer_def_create(
                &mut p,
                name.as_ptr(),
                Some(forward_trampoline),
                if has_backward {
                    Some(backward_trampoline)
                } else {
                    None
                },
                Some(release_trampoline),
                user_data,
            )
        })?;
        let ptr = NonNull::new(p)
            .ok_or_else(|| Error::new(Status::Internal, "rp_layer_def_create returned NULL"))?;
        Ok(LayerDef { ptr, state })
    }

    /// A layer that passes no gradient (no trainable parameters, inputs that need none).
    pub fn forward_only<F>(type_name: &str, forward: F) -> Result<LayerDef>
    where
        F: FnMut(&mut LayerCall<'_>, &[TensorView<'_>]) -> std::result::Result<LayerOutput, String>
            + Send
            + 'static,
    {
        LayerDef::new(type_name, forward, None::<Box<BackwardFn>>)
    }

    /// Declare a parameter (its shape and value are `initial`'s, copied now). `trainable`:
    /// gets gradients and optimizer updates (must be floating); else frozen.
    pub fn add_param(
        &mut self,
        name: &str,
        initial: &dyn AsDlpack,
        trainable: bool,
    ) -> Result<&mut Self> {
        let c = CString::new(name).map_err(|_| Error::invalid("name contains a NUL byte"))?;
        let managed = borrowed_managed(&[initial]);
        check(unsafe {
            sys::rp_layer_def_add_param(
                self.ptr.as_ptr(),
                c.as_ptr(),
                &managed[0],
                trainable as i32,
            )
        })?;
        Ok(self)
    }

    /// Declare a buffer (state that is not trained), copied from `initial`.
    pub fn add_buffer(&mut self, name: &str, initial: &dyn AsDlpack) -> Result<&mut Self> {
        let c = CString::new(name).map_err(|_| Error::invalid("name contains a NUL byte"))?;
        let managed = borrowed_managed(&[initial]);
        check(unsafe { sys::rp_layer_def_add_buffer(self.ptr.as_ptr(), c.as_ptr(), &managed[0]) })?;
        Ok(self)
    }

    /// Device bytes the layer's forward with gradients keeps for backward, per token, in the
    /// model dtype (rp_layer_def_set_activation_bytes): the planner sizes stages with it under
    /// a GPU memory cap.
    pub fn set_activation_bytes(&mut self, bytes_per_token: f64) -> Result<&mut Self> {
        check(unsafe {
            sys::rp_layer_def_set_activation_bytes(self.ptr.as_ptr(), bytes_per_token)
        })?;
        Ok(self)
    }

    /// Relative cost of the layer for the stage planner.
    pub fn set_cost(&mut self, cost: f64) -> Result<&mut Self> {
        check(unsafe { sys::rp_layer_def_set_cost(self.ptr.as_ptr(), cost) })?;
        Ok(self)
    }

    pub(crate) fn as_ptr(&self) -> *const sys::rp_layer_def {
        self.ptr.as_ptr()
    }

    pub(crate) fn state(&self) -> Arc<LayerState> {
        Arc::clone(&self.state)
    }
}

impl Drop for LayerDef {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once; models keep their own copies of the def and
        // their own reference to the closures.
        unsafe { sys::rp_layer_def_destroy(self.ptr.as_ptr()) }
    }
}
