"""Moving torch tensors across the C API as DLPack ``DLManagedTensor``, without copies.

Three ownership cases, as the header defines them:
  * inputs we lend to the library for one call (:class:`BorrowedInputs`): a
    ``torch.utils.dlpack.to_dlpack`` capsule per tensor, kept alive for the call; the capsule
    still owns its DLManagedTensor and frees it when collected;
  * tensors the library returns to us (:func:`from_owned`): wrapped in a ``"dltensor"``
    capsule that ``torch.utils.dlpack.from_dlpack`` consumes, so torch calls the library's
    deleter when the tensor dies;
  * tensors we hand over for good (:func:`to_owned`, for loss gradients and split pieces): the
    capsule is renamed ``"used_dltensor"`` so that it no longer frees what the library now owns.
Tensors the library lends to a callback are valid only during the callback: :func:`copy_borrowed`
copies them into torch-owned memory; :func:`borrow` gives a zero-copy view for code that
guarantees the view is not read after the callback (the Python layers, see _python_layer).
"""

import ctypes
import threading
from ctypes import POINTER, c_char_p, c_int, c_void_p, py_object

import torch
import torch.utils.dlpack

from ._capi import DLManagedTensor, DLManagedTensorDeleter

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = py_object
_api.PyCapsule_New.argtypes = [c_void_p, c_char_p, c_void_p]
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_GetPointer.argtypes = [py_object, c_char_p]
_api.PyCapsule_SetName.restype = c_int
_api.PyCapsule_SetName.argtypes = [py_object, c_char_p]
_api.PyCapsule_IsValid.restype = c_int
_api.PyCapsule_IsValid.argtypes = [py_object, c_char_p]

# PyCapsule_New keeps the name pointer, so the names must live as long as the process.
_DLTENSOR = c_char_p(b"dltensor")
_USED_DLTENSOR = c_char_p(b"used_dltensor")


def _export(tensor):
    """A "dltensor" capsule for `tensor` (detached, contiguous) and its DLManagedTensor*."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    capsule = torch.utils.dlpack.to_dlpack(t)
    ptr = _api.PyCapsule_GetPointer(capsule, _DLTENSOR)
    return capsule, ptr


class BorrowedInputs:
    """DLPack views of tensors, lent to the library for one call.

    ``array`` is a ``DLManagedTensor *[n]`` for the C call; keep this object alive until the
    call has returned.
    """

    def __init__(self, tensors):
        self._capsules = []
        ptrs = []
        cuda_devices = set()
        for t in tensors:
            capsule, ptr = _export(t)
            self._capsules.append(capsule)
            ptrs.append(ptr)
            if t.is_cuda:
                cuda_devices.add(t.device)
        # The C API takes no stream: make work queued on torch's current streams visible first.
        for dev in cuda_devices:
            torch.cuda.current_stream(dev).synchronize()
        self.count = len(ptrs)
        self.array = (c_void_p * max(1, len(ptrs)))(*ptrs)
        self.pointers = ptrs


def to_owned(tensor):
    """Hand `tensor` to the library for good: returns a DLManagedTensor* whose deleter the
    library will call. The tensor's memory stays alive until then."""
    capsule, ptr = _export(tensor)
    _api.PyCapsule_SetName(capsule, _USED_DLTENSOR)  # the capsule no longer owns it
    return ptr


def delete_owned(ptr):
    """Call the deleter of a DLManagedTensor* we own."""
    if not ptr:
        return
    managed = ctypes.cast(ptr, POINTER(DLManagedTensor)).contents
    if managed.deleter:
        managed.deleter(ctypes.cast(ptr, POINTER(DLManagedTensor)))


def from_owned(ptr):
    """A torch tensor over a DLManagedTensor* the library gave us (zero-copy). Torch calls its
    deleter when the tensor (and every view of it) is gone."""
    capsule = _api.PyCapsule_New(ptr, _DLTENSOR, None)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        if _api.PyCapsule_IsValid(capsule, _DLTENSOR):  # not consumed: still ours to free
            delete_owned(ptr)
        raise


def copy_borrowed(ptr):
    """A torch-owned copy of a DLManagedTensor* lent to a callback (None for NULL)."""
    if not ptr:
        return None
    src = ctypes.cast(ptr, POINTER(DLManagedTensor)).contents
    # A private DLManagedTensor with the same DLTensor and no deleter: the lender keeps
    # ownership, and our temporary view must not free anything.
    shadow = DLManagedTensor()
    shadow.dl_tensor = src.dl_tensor
    shadow.manager_ctx = None
    capsule = _api.PyCapsule_New(ctypes.addressof(shadow), _DLTENSOR, None)
    view = torch.utils.dlpack.from_dlpack(capsule)
    copy = view.clone()
    del view, capsule  # the view (and torch's pointer to `shadow`) dies before `shadow`
    return copy


# Zero-copy views of lent tensors. torch keeps the DLManagedTensor* it consumed and calls its
# deleter when the view's storage dies, possibly after the callback; so each view gets its own
# shadow DLManagedTensor (same DLTensor, our deleter), alive until torch releases it. The
# lender's own struct is never touched: its deleter is the lender's.
_shadows = {}
_shadows_lock = threading.Lock()


def _release_shadow(ptr):
    with _shadows_lock:
        _shadows.pop(ctypes.cast(ptr, c_void_p).value, None)


_RELEASE_SHADOW = DLManagedTensorDeleter(_release_shadow)


def borrow(ptr):
    """A zero-copy torch view of a DLManagedTensor* lent to a callback (None for NULL). The
    memory is the lender's: valid only while the lender says so (for a callback, its
    duration)."""
    if not ptr:
        return None
    src = ctypes.cast(ptr, POINTER(DLManagedTensor)).contents
    shadow = DLManagedTensor()
    shadow.dl_tensor = src.dl_tensor
    shadow.manager_ctx = None
    shadow.deleter = _RELEASE_SHADOW
    address = ctypes.addressof(shadow)
    with _shadows_lock:
        _shadows[address] = shadow
    capsule = _api.PyCapsule_New(address, _DLTENSOR, None)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        if _api.PyCapsule_IsValid(capsule, _DLTENSOR):  # not consumed: torch holds nothing
            with _shadows_lock:
                _shadows.pop(address, None)
        raise
