"""A Python loss_fn on the device, with torch autograd (rp_loss_create_device_callback).

The engine calls it once per microbatch on the device where the tail stage ran, with that
microbatch's outputs in the model dtype. The outputs get their structure back (the last layer's
pytree), the labels are the binding's per-microbatch split of any pytree (moved to the outputs'
device, as upstream's loss runs on the GPU), and the gradient of the loss with respect to each
floating output comes from torch.autograd.grad.
"""

import torch

from . import _capi
from ._callbacks import _CallbackScope, loss_terms, registry
from ._dlpack import borrow, copy_borrowed, to_owned
from ._python_layer import LayerCall, _push, owned_copy_if_lent


class DeviceLossCall:
    """One forward_backward with a Python loss_fn. `labels`: per-microbatch labels (split by
    the binding) or None; `output_spec(microbatch)`: the Spec of the model's outputs."""

    def __init__(self, fn, labels, output_spec):
        self.fn = fn
        self.labels = labels
        self.output_spec = output_spec
        self.exc = None

    def compute(self, out_loss, out_grads, call, outputs, n_outputs, labels_ptr):
        lend = LayerCall(call, with_tensors=False)
        with lend.on_device():  # label copies, autograd and the exported copies: lent stream
            self._compute(lend, out_loss, out_grads, outputs, n_outputs, labels_ptr)

    def _compute(self, lend, out_loss, out_grads, outputs, n_outputs, labels_ptr):
        lent = [borrow(outputs[i]) for i in range(n_outputs)]
        leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in lent]
        if self.labels is not None:
            label = _to_device(self.labels[lend.microbatch], lend.device)
        else:
            label = copy_borrowed(labels_ptr) if labels_ptr else None
        value = self.output_spec(lend.microbatch).unflatten(leaves)
        with torch.enable_grad():
            losses = loss_terms(self.fn(value, label))
            total = sum(loss.reshape(()) for loss in losses)
            wanted = [t for t in leaves if t.requires_grad]
            grads = torch.autograd.grad(total, wanted, allow_unused=True) \
                if total.requires_grad and wanted else [None] * len(wanted)
        grads = iter(grads)
        lent_ptrs = {t.untyped_storage().data_ptr() for t in lent}
        for t in leaves:
            g = next(grads) if t.requires_grad else None
            _push(out_grads, None if g is None else owned_copy_if_lent(g, lent_ptrs))
        out_loss[0] = to_owned(total.detach().reshape(1).clone())


def _to_device(label, device):
    """Tensor leaves of a label pytree on `device` (others as they are)."""
    if isinstance(label, torch.Tensor):
        return label.to(device, non_blocking=True)
    if isinstance(label, (tuple, list)) and not hasattr(label, "_fields"):
        return type(label)(_to_device(x, device) for x in label)
    if isinstance(label, dict):
        return {k: _to_device(v, device) for k, v in label.items()}
    return label


def _loss_entry(out_loss, out_grads, call, outputs, n_outputs, labels, user_data):
    with _CallbackScope(library_thread=True):
        loss_call = registry.get(user_data)
        if loss_call is None:
            return 1
        try:
            loss_call.compute(out_loss, out_grads, call, outputs, n_outputs, labels)
            return 0
        except BaseException as exc:  # noqa: B902 - nothing may escape into C
            if loss_call.exc is None:  # re-raised as it is, as before (test_errors)
                loss_call.exc = exc
            return 1


DEVICE_LOSS_TRAMPOLINE = _capi.rp_device_loss_fn(_loss_entry)


def python_loss(scope, loss_fn, labels, state, last_python_index):
    """The rp_loss of a Python loss_fn for one call (owned by `scope`'s caller): on the device
    with torch autograd, or, with a library from before device losses, the older callback on
    fp32 CPU copies of the outputs. `last_python_index`: the index of the last layer when it
    is a Python layer (its outputs are pytrees), else None (one tensor)."""
    from ._capi import missing_layer_api
    from ._callbacks import LossCall
    from ._internals import Loss
    from ._pytree import flatten
    if missing_layer_api() is not None:
        return Loss.callback(scope.register(LossCall(loss_fn, labels)))
    if last_python_index is None:
        single = flatten(torch.empty(0))[1]
        spec_of = lambda mb: single  # noqa: E731
    else:
        spec_of = lambda mb: state.specs[(mb, last_python_index)]  # noqa: E731
    return Loss.device_callback(scope.register(DeviceLossCall(loss_fn, labels, spec_of)))
