//! Tensors across the C API, as DLPack.
//!
//! * [`Tensor`]: a tensor owned by Rust (contiguous, on the CPU). Passed to the library it is
//!   borrowed for the call; given to it from a loss callback it is moved into a DLPack struct
//!   whose deleter frees it.
//! * [`DlTensor`]: a tensor the library gave you (outputs, parameter views). You own the DLPack
//!   reference; dropping it calls its deleter.
//! * [`TensorView`]: a borrowed look at any of these (and at the tensors a callback receives).

use std::marker::PhantomData;
use std::mem;
use std::os::raw::c_void;
use std::ptr::{self, NonNull};
use std::slice;

use roundpipe_sys as sys;

use crate::error::{Error, Result};

/// Element types a tensor may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    Bool,
}

impl DType {
    /// The DLPack description of this type.
    pub fn to_dlpack(self) -> sys::DLDataType {
        let (code, bits) = match self {
            DType::F32 => (sys::kDLFloat, 32),
            DType::F64 => (sys::kDLFloat, 64),
            DType::F16 => (sys::kDLFloat, 16),
            DType::BF16 => (sys::kDLBfloat, 16),
            DType::I8 => (sys::kDLInt, 8),
            DType::I16 => (sys::kDLInt, 16),
            DType::I32 => (sys::kDLInt, 32),
            DType::I64 => (sys::kDLInt, 64),
            DType::U8 => (sys::kDLUInt, 8),
            DType::U16 => (sys::kDLUInt, 16),
            DType::U32 => (sys::kDLUInt, 32),
            DType::U64 => (sys::kDLUInt, 64),
            DType::Bool => (sys::kDLBool, 8),
        };
        sys::DLDataType {
            code: code as u8,
            bits,
            lanes: 1,
        }
    }

    /// The type a DLPack description names (`None` for vectors and unknown types).
    pub fn from_dlpack(t: sys::DLDataType) -> Option<DType> {
        if t.lanes != 1 {
            return None;
        }
        Some(match (t.code as i32, t.bits) {
            (sys::kDLFloat, 32) => DType::F32,
            (sys::kDLFloat, 64) => DType::F64,
            (sys::kDLFloat, 16) => DType::F16,
            (sys::kDLBfloat, 16) => DType::BF16,
            (sys::kDLInt, 8) => DType::I8,
            (sys::kDLInt, 16) => DType::I16,
            (sys::kDLInt, 32) => DType::I32,
            (sys::kDLInt, 64) => DType::I64,
            (sys::kDLUInt, 8) => DType::U8,
            (sys::kDLUInt, 16) => DType::U16,
            (sys::kDLUInt, 32) => DType::U32,
            (sys::kDLUInt, 64) => DType::U64,
            (sys::kDLBool, 8) => DType::Bool,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }
}

/// Rust element types with a DLPack equivalent. Sealed: implemented for the primitive types
/// below only (f16 and bf16 data is handled as raw bytes through [`Tensor::from_bytes`]).
pub trait Element: Copy + Send + 'static + sealed::Sealed {
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(f32 => F32, f64 => F64, i8 => I8, i16 => I16, i32 => I32, i64 => I64, u8 => U8,
         u16 => U16, u32 => U32, u64 => U64, bool => Bool);

/// Where a tensor's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    /// `DLDeviceType` (`kDLCPU` = 1, `kDLCUDA` = 2, ...).
    pub kind: i32,
    /// Index of the device of that kind.
    pub id: i32,
}

impl Device {
    pub const CPU: Device = Device {
        kind: sys::kDLCPU,
        id: 0,
    };

    /// Whether the host can read the memory directly.
    pub fn is_host(self) -> bool {
        self.kind == sys::kDLCPU || self.kind == sys::kDLCUDAHost
    }
}

fn numel_of(shape: &[i64]) -> Result<usize> {
    let mut n: usize = 1;
    for &d in shape {
        if d < 0 {
            return Err(Error::invalid(format!(
                "negative dimension {} in shape {:?}",
                d, shape
            )));
        }
        n = n
            .checked_mul(d as usize)
            .ok_or_else(|| Error::invalid(format!("shape {:?} is too large", shape)))?;
    }
    Ok(n)
}

/// A contiguous CPU tensor owned by Rust.
///
/// Storage is kept 8-byte aligned whatever the element type, as the library's kernels prefer.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    words: Vec<u64>,
    nbytes: usize,
    shape: Vec<i64>,
    dtype: DType,
}

impl Tensor {
    /// A tensor of `shape` holding `data` (row-major). Errors when the sizes disagree.
    pub fn new<T: Element>(data: &[T], shape: &[i64]) -> Result<Tensor> {
        let n = numel_of(shape)?;
        if n != data.len() {
            return Err(Error::invalid(format!(
                "shape {:?} holds {} elements, {} given",
                shape,
                n,
                data.len()
            )));
        }
        // SAFETY: `data` is a valid slice of plain-old-data elements.
        let bytes =
            unsafe { slice::from_raw_parts(data.as_ptr() as *const u8, mem::size_of_val(data)) };
        Self::from_bytes(T::DTYPE, bytes, shape)
    }

    /// A tensor of `shape` and `dtype` whose elements are `bytes` (native byte order).
    pub fn from_bytes(dtype: DType, bytes: &[u8], shape: &[i64]) -> Result<Tensor> {
        let n = numel_of(shape)?;
        if n * dtype.size() != bytes.len() {
            return Err(Error::invalid(format!(
                "shape {:?} of {:?} needs {} bytes, {} given",
                shape,
                dtype,
                n * dtype.size(),
                bytes.len()
            )));
        }
        let mut words = vec![0u64; (bytes.len() + 7) / 8];
        // SAFETY: `words` holds at least bytes.len() bytes; the regions do not overlap.
        unsafe {
            ptr::copy_nonoverlapping(bytes.as_ptr(), words.as_mut_ptr() as *mut u8, bytes.len())
        };
        Ok(Tensor {
            words,
            nbytes: bytes.len(),
            shape: shape.to_vec(),
            dtype,
        })
    }

    /// A tensor of zeros.
    pub fn zeros(dtype: DType, shape: &[i64]) -> Result<Tensor> {
        let n = numel_of(shape)?;
        Ok(Tensor {
            words: vec![0u64; (n * dtype.size() + 7) / 8],
            nbytes: n * dtype.size(),
            shape: shape.to_vec(),
            dtype,
        })
    }

    /// A 0-d tensor.
    pub fn scalar<T: Element>(value: T) -> Tensor {
        Tensor::new(&[value], &[]).expect("a scalar always fits")
    }

    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.nbytes / self.dtype.size()
    }

    /// The elements, when they are of type `T`.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        check_dtype::<T>(self.dtype)?;
        // SAFETY: the buffer holds numel() elements of T, aligned to 8 bytes.
        Ok(unsafe { slice::from_raw_parts(self.words.as_ptr() as *const T, self.numel()) })
    }

    /// The elements, mutable, when they are of type `T`.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        check_dtype::<T>(self.dtype)?;
        let n = self.numel();
        // SAFETY: as in as_slice, and &mut self makes the access exclusive.
        Ok(unsafe { slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut T, n) })
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the buffer holds at least nbytes bytes.
        unsafe { slice::from_raw_parts(self.words.as_ptr() as *const u8, self.nbytes) }
    }

    /// A borrowed view.
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            t: self.raw(),
            _life: PhantomData,
        }
    }

    /// A DLTensor describing this tensor, valid while `self` is neither moved nor changed.
    fn raw(&self) -> sys::DLTensor {
        sys::DLTensor {
            data: self.words.as_ptr() as *mut c_void,
            device: sys::DLDevice {
                device_type: sys::kDLCPU,
                device_id: 0,
            },
            ndim: self.shape.len() as i32,
            dtype: self.dtype.to_dlpack(),
            shape: self.shape.as_ptr() as *mut i64,
            strides: ptr::null_mut(),
            byte_offset: 0,
        }
    }

    /// A DLPack struct (no deleter) through which the library may write this tensor's
    /// elements, valid while the `&mut` borrow lasts.
    pub(crate) fn borrowed_mut(&mut self) -> sys::DLManagedTensor {
        let mut t = self.raw();
        t.data = self.words.as_mut_ptr() as *mut c_void;
        sys::DLManagedTensor {
            dl_tensor: t,
            manager_ctx: ptr::null_mut(),
            deleter: None,
        }
    }

    /// Move this tensor into a heap DLPack struct whose deleter frees it (for handing a tensor
    /// to the library for good, as a loss callback's gradient).
    pub(crate) fn into_managed(self) -> *mut sys::DLManagedTensor {
        struct Holder {
            managed: sys::DLManagedTensor,
            tensor: Tensor,
        }
        unsafe extern "C" fn delete(p: *mut sys::DLManagedTensor) {
            if !p.is_null() {
                // SAFETY: manager_ctx is the Box made below; the library calls this once.
                drop(Box::from_raw((*p).manager_ctx as *mut Holder));
            }
        }
        let mut holder = Box::new(Holder {
            managed: sys::DLManagedTensor {
                dl_tensor: self.raw(),
                manager_ctx: ptr::null_mut(),
                deleter: Some(delete),
            },
            tensor: self,
        });
        // The tensor's heap buffers did not move with it into the box, but take the pointers
        // from their final owner anyway.
        holder.managed.dl_tensor = holder.tensor.raw();
        let raw = Box::into_raw(holder);
        // SAFETY: raw is a valid, uniquely owned Holder.
        unsafe {
            (*raw).managed.manager_ctx = raw as *mut c_void;
            &mut (*raw).managed
        }
    }
}

fn check_dtype<T: Element>(have: DType) -> Result<()> {
    if have == T::DTYPE {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "tensor holds {:?}, asked for {:?}",
            have,
            T::DTYPE
        )))
    }
}

/// Anything that can be passed to the library as an input tensor, borrowed for one call.
pub trait AsDlpack {
    /// A DLTensor describing the data; it must stay valid while `self` is borrowed.
    fn dl_tensor(&self) -> sys::DLTensor;
}

impl AsDlpack for Tensor {
    fn dl_tensor(&self) -> sys::DLTensor {
        self.raw()
    }
}

impl AsDlpack for DlTensor {
    fn dl_tensor(&self) -> sys::DLTensor {
        self.raw().dl_tensor
    }
}

impl AsDlpack for TensorView<'_> {
    fn dl_tensor(&self) -> sys::DLTensor {
        self.t
    }
}

/// DLPack structs borrowing `tensors` for one call (no deleter: the library only borrows them).
pub(crate) fn borrowed_managed(tensors: &[&dyn AsDlpack]) -> Vec<sys::DLManagedTensor> {
    tensors
        .iter()
        .map(|t| sys::DLManagedTensor {
            dl_tensor: t.dl_tensor(),
            manager_ctx: ptr::null_mut(),
            deleter: None,
        })
        .collect()
}

/// Optional gradients for `rp_backward` / `rp_backward_input_grads`: the borrowed DLPack
/// structs of the present ones, and one pointer per entry into them (null for `None`). The
/// pointers stay valid while the returned vector lives (its heap buffer never moves).
pub(crate) fn optional_managed(
    grads: &[Option<&dyn AsDlpack>],
) -> (Vec<sys::DLManagedTensor>, Vec<*const sys::DLManagedTensor>) {
    let present: Vec<&dyn AsDlpack> = grads.iter().flatten().copied().collect();
    let managed = borrowed_managed(&present);
    let mut next = managed.iter();
    let ptrs = grads
        .iter()
        .map(|g| match g {
            Some(_) => next.next().map_or(ptr::null(), |m| m as *const _),
            None => ptr::null(),
        })
        .collect();
    (managed, ptrs)
}

/// A borrowed look at a DLPack tensor: shape, type, device and (host memory) the elements.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub(crate) t: sys::DLTensor,
    _life: PhantomData<&'a ()>,
}

impl<'a> TensorView<'a> {
    /// # Safety
    /// `t` must describe memory (data, shape, strides) valid for `'a`.
    pub(crate) unsafe fn from_raw(t: &'a sys::DLTensor) -> TensorView<'a> {
        TensorView {
            t: *t,
            _life: PhantomData,
        }
    }

    pub fn shape(&self) -> &'a [i64] {
        if self.t.ndim <= 0 || self.t.shape.is_null() {
            return &[];
        }
        // SAFETY: DLPack promises ndim sizes at `shape`, valid for the view's life.
        unsafe { slice::from_raw_parts(self.t.shape, self.t.ndim as usize) }
    }

    /// Strides in elements, or `None` for a compact row-major tensor (DLPack's NULL).
    pub fn strides(&self) -> Option<&'a [i64]> {
        if self.t.strides.is_null() || self.t.ndim <= 0 {
            None
        } else {
            // SAFETY: as for shape.
            Some(unsafe { slice::from_raw_parts(self.t.strides, self.t.ndim as usize) })
        }
    }

    /// Element type (`None` for types this binding does not name).
    pub fn dtype(&self) -> Option<DType> {
        DType::from_dlpack(self.t.dtype)
    }

    pub fn device(&self) -> Device {
        Device {
            kind: self.t.device.device_type,
            id: self.t.device.device_id,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape().iter().map(|&d| d.max(0) as usize).product()
    }

    /// Whether the elements are compact and row-major.
    pub fn is_contiguous(&self) -> bool {
        let strides = match self.strides() {
            None => return true,
            Some(s) => s,
        };
        let mut expected = 1i64;
        for (&d, &s) in self.shape().iter().zip(strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }

    pub(crate) fn data_ptr<T: Element>(&self) -> Result<*mut T> {
        let dtype = self.dtype().ok_or_else(|| {
            Error::invalid(format!("unsupported DLPack dtype {:?}", self.t.dtype))
        })?;
        check_dtype::<T>(dtype)?;
        if !self.device().is_host() {
            return Err(Error::invalid(format!(
                "tensor is on device {:?}, not in host memory",
                self.device()
            )));
        }
        if !self.is_contiguous() {
            return Err(Error::invalid("tensor is not contiguous"));
        }
        let p = (self.t.data as *mut u8).wrapping_add(self.t.byte_offset as usize) as *mut T;
        if self.numel() > 0 && (p.is_null() || (p as usize) % mem::align_of::<T>() != 0) {
            return Err(Error::invalid("tensor data is NULL or misaligned"));
        }
        Ok(p)
    }

    /// The elements (host memory, contiguous, type `T`).
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
        let p = self.data_ptr::<T>()?;
        if self.numel() == 0 {
            return Ok(&[]);
        }
        // SAFETY: checked type, device, layout and alignment; valid for 'a by construction.
        Ok(unsafe { slice::from_raw_parts(p, self.numel()) })
    }

    /// A copy of the elements.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        Ok(self.as_slice::<T>()?.to_vec())
    }

    /// A copy as an owned [`Tensor`] (host memory, contiguous).
    pub fn to_tensor(&self) -> Result<Tensor> {
        let dtype = self
            .dtype()
            .ok_or_else(|| Error::invalid("unsupported DLPack dtype"))?;
        if !self.device().is_host() || !self.is_contiguous() {
            return Err(Error::invalid("only contiguous host tensors can be copied"));
        }
        let nbytes = self.numel() * dtype.size();
        let p = (self.t.data as *const u8).wrapping_add(self.t.byte_offset as usize);
        let bytes: &[u8] = if nbytes == 0 {
            &[]
        } else {
            // SAFETY: host memory holding numel elements, valid for 'a.
            unsafe { slice::from_raw_parts(p, nbytes) }
        };
        Tensor::from_bytes(dtype, bytes, self.shape())
    }
}

impl std::fmt::Debug for TensorView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorView")
            .field("shape", &self.shape())
            .field("dtype", &self.dtype())
            .field("device", &self.device())
            .finish()
    }
}

/// A DLPack tensor the library gave you. Dropping it calls its deleter.
pub struct DlTensor {
    ptr: NonNull<sys::DLManagedTensor>,
}

// SAFETY: the tensor is an owned reference; libtorch's DLPack deleters may run on any thread.
unsafe impl Send for DlTensor {}

impl DlTensor {
    /// Take ownership of a DLPack tensor (NULL gives `None`).
    ///
    /// # Safety
    /// `p` must be NULL or a valid DLManagedTensor that nobody else will delete.
    pub unsafe fn from_raw(p: *mut sys::DLManagedTensor) -> Option<DlTensor> {
        NonNull::new(p).map(|ptr| DlTensor { ptr })
    }

    /// Give up ownership: the caller must call the deleter.
    pub fn into_raw(self) -> *mut sys::DLManagedTensor {
        let p = self.ptr.as_ptr();
        mem::forget(self);
        p
    }

    fn raw(&self) -> &sys::DLManagedTensor {
        // SAFETY: owned and valid until drop.
        unsafe { self.ptr.as_ref() }
    }

    /// A borrowed view (shape, dtype, elements).
    pub fn view(&self) -> TensorView<'_> {
        // SAFETY: the memory stays valid while self is held.
        unsafe { TensorView::from_raw(&self.raw().dl_tensor) }
    }

    pub fn shape(&self) -> &[i64] {
        self.view().shape()
    }

    pub fn dtype(&self) -> Option<DType> {
        self.view().dtype()
    }

    pub fn device(&self) -> Device {
        self.view().device()
    }

    pub fn numel(&self) -> usize {
        self.view().numel()
    }

    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.view().as_slice::<T>()
    }

    /// The elements, writable (a parameter's master weight, for instance).
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let v = self.view();
        let p = v.data_ptr::<T>()?;
        let n = v.numel();
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: checked as in as_slice; &mut self makes this binding's access exclusive.
        Ok(unsafe { slice::from_raw_parts_mut(p, n) })
    }

    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.view().to_vec::<T>()
    }

    pub fn to_tensor(&self) -> Result<Tensor> {
        self.view().to_tensor()
    }
}

impl Drop for DlTensor {
    fn drop(&mut self) {
        // SAFETY: we own the reference; its deleter (if any) frees it exactly once.
        unsafe {
            if let Some(del) = self.ptr.as_ref().deleter {
                del(self.ptr.as_ptr());
            }
        }
    }
}

impl std::fmt::Debug for DlTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DlTensor")
            .field("shape", &self.shape())
            .field("dtype", &self.dtype())
            .field("device", &self.device())
            .finish()
    }
}
