"""After synchronize(): the user's nn.Module holds the engine's latest state.

Upstream's synchronize() leaves the model's parameters at the latest weights and their .grad at
the accumulated gradients, so that ``torch.save(model.model.state_dict())`` saves the trained
model. Here every engine tensor (trainable and frozen parameters, buffers; ``rp_param_kind_of``
says which) is copied into the module tensor it came from, and each trainable parameter's
gradient into that parameter's .grad (None where no call reached it, as autograd leaves it).
Frozen parameters do not change in training, so the caller may skip them (a LoRA model's frozen
base is nearly all of it).
"""

from ctypes import c_char_p, c_size_t, c_void_p

import torch

from . import _capi
from ._capi import lib
from ._dlpack import from_owned
from ._internals import grad_or_none, param_kind, query


def module_tensors(module):
    """name -> tensor of every parameter and buffer of `module` (shared ones under each
    name)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def copy_into_module(model_ptr, module, names, frozen=True):
    """Copy the engine's tensors into `module`; `names` maps engine names to module names
    (tensors without a module name are skipped); frozen parameters only with `frozen`."""
    L = lib()
    targets = module_tensors(module)
    engine_index = {}
    for i in range(query(L.rp_param_count, model_ptr, ctype=c_size_t)):
        engine_index[query(L.rp_param_name, model_ptr, i,
                           ctype=c_char_p).decode()] = i
    with torch.no_grad():
        for engine_name, module_name in names.items():
            target = targets.get(module_name)
            i = engine_index.get(engine_name)
            if target is None or i is None:
                continue
            kind = param_kind(model_ptr, i)
            if kind == _capi.RP_PARAM_FROZEN and not frozen:
                continue
            value = from_owned(query(L.rp_param_master, model_ptr, i, ctype=c_void_p))
            target.copy_(value.to(device=target.device, dtype=target.dtype))
            if kind != _capi.RP_PARAM_TRAINABLE:
                continue
            grad = grad_or_none(model_ptr, i)
            target.grad = None if grad is None else \
                grad.to(device=target.device, dtype=target.dtype, copy=True)
