//! Tensor lists the library returns (outputs, microbatch pieces), and the engine's microbatch
//! split for callers that want to see it.

use std::ptr;
use std::slice;

use roundpipe_sys as sys;

use crate::config::Split;
use crate::error::{check, Error, Result, Status};
use crate::tensor::{borrowed_managed, AsDlpack, DlTensor, Tensor, TensorView};

/// The tensors of an output list (new references the caller owns); the list is freed.
pub(crate) fn take_list(list: *mut sys::rp_tensor_list) -> Result<Vec<DlTensor>> {
    take_list_optional(list)?
        .into_iter()
        .map(|t| t.ok_or_else(|| Error::new(Status::Internal, "NULL output tensor")))
        .collect()
}

/// As `take_list`, for lists with NULL entries (`None`).
pub(crate) fn take_list_optional(list: *mut sys::rp_tensor_list) -> Result<Vec<Option<DlTensor>>> {
    struct Guard(*mut sys::rp_tensor_list);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: owned list, destroyed once; tensors taken from it stay valid.
            unsafe { sys::rp_tensor_list_destroy(self.0) }
        }
    }
    let guard = Guard(list);
    let mut n = 0usize;
    check(unsafe { sys::rp_tensor_list_size(&mut n, guard.0) })?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut t = ptr::null_mut();
        check(unsafe { sys::rp_tensor_list_get(&mut t, guard.0, i) })?;
        // SAFETY: a new reference owned by the caller, or NULL.
        out.push(unsafe { DlTensor::from_raw(t) });
    }
    Ok(out)
}

/// The pieces the engine makes of an input or of the labels for `num_microbatch`
/// microbatches, as compact copies: along `split`'s dimension with the sizes of
/// `torch.tensor_split` (the first pieces one row larger when the rows do not divide evenly),
/// or the whole tensor for each microbatch with [`Split::Replicate`] and for 0-d tensors. The
/// rule and its errors are the engine's (`rp_split_microbatches`), so every binding splits
/// alike.
pub fn split_microbatches(
    tensor: &dyn AsDlpack,
    split: Split,
    num_microbatch: i32,
) -> Result<Vec<Tensor>> {
    crate::ensure_abi()?;
    let managed = borrowed_managed(&[tensor]);
    let mut list = ptr::null_mut();
    // SAFETY: the tensor is borrowed for the call; the pieces are views of its memory, which
    // `tensor` keeps alive until they are copied below.
    check(unsafe {
        sys::rp_split_microbatches(&mut list, &managed[0], split.code(), num_microbatch)
    })?;
    take_list(list)?
        .iter()
        .map(|piece| compact_copy(&piece.view()))
        .collect()
}

/// A compact copy of a host tensor, strided or not (pieces split along an inner dimension are
/// strided views).
fn compact_copy(v: &TensorView<'_>) -> Result<Tensor> {
    let strides = match v.strides() {
        Some(s) if !v.is_contiguous() => s,
        _ => return v.to_tensor(),
    };
    let dtype = v
        .dtype()
        .ok_or_else(|| Error::invalid("unsupported DLPack dtype"))?;
    if !v.device().is_host() {
        return Err(Error::invalid("only host tensors can be copied"));
    }
    let (shape, size) = (v.shape(), dtype.size());
    let base = (v.t.data as *const u8).wrapping_add(v.t.byte_offset as usize);
    let mut bytes = Vec::with_capacity(v.numel() * size);
    let mut index = vec![0i64; shape.len()];
    for _ in 0..v.numel() {
        let offset: i64 = index.iter().zip(strides).map(|(i, s)| i * s).sum();
        // SAFETY: DLPack promises an element at every in-bounds index of shape and strides.
        let p = base.wrapping_offset(offset as isize * size as isize);
        bytes.extend_from_slice(unsafe { slice::from_raw_parts(p, size) });
        // Next index in row-major order: the last dimension moves fastest.
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Tensor::from_bytes(dtype, &bytes, shape)
}
