"""RoundPipe's weights: state dicts, copies into the user's module, Hugging Face directories and
safetensors files, generation. A mixin of :class:`roundpipe.RoundPipe` (model.py), which owns the
engine handle (``_model``), the parameter views (``_params``) and what it knows of its source
(``model``, ``_original_model``, ``_module_names``, ``_hf_config``, ``_causal_lm``)."""

import os
from collections import OrderedDict
from typing import Any, Optional

import torch

from ._module_sync import module_tensors
from .causal_lm import generate as _generate
from .errors import RoundPipeError, RoundPipeUnsupportedError, Status


class WeightsMixin:
    # -- weights ------------------------------------------------------------------------------

    def _copy_in(self, named):
        """Write (engine name, tensor) pairs into the master weights and buffers and publish
        them (the module's own tensors are not read back: they may be the source)."""
        self._sync_engine()
        params = self._all_tensors()
        with torch.no_grad():
            for name, value in named:
                params[name].copy_(value.detach().to(device="cpu"))
        self._sync_engine()
        self._module_frozen_stale = True

    def _all_tensors(self):
        """engine name -> master weight (parameters) or held value (buffers)."""
        named = dict(self._params.build())
        named.update(self._params.buffers)
        return named

    def state_dict(self):
        """Copies of the latest weights and buffers (synchronizes first), by engine name."""
        self.synchronize()
        return OrderedDict((name, p.detach().clone()) for name, p in
                           list(self._params.build()) + list(self._params.buffers))

    def load_state_dict(self, state_dict, strict=True):
        """Copy weights into the model by engine parameter name (synchronizes before and
        after). With strict, every parameter must be given and nothing else."""
        params = self._all_tensors()
        unexpected = [k for k in state_dict if k not in params]
        missing = [k for k in params if k not in state_dict]
        if strict and (unexpected or missing):
            raise RoundPipeError(Status.INVALID_ARGUMENT, "load_state_dict: missing %s, "
                                 "unexpected %s" % (missing, unexpected))
        for k, v in state_dict.items():
            if k in params and tuple(v.shape) != tuple(params[k].shape):
                raise RoundPipeError(Status.INVALID_ARGUMENT, "load_state_dict: %s has shape %s,"
                                     " the model's is %s" % (k, tuple(v.shape),
                                                             tuple(params[k].shape)))
        self._copy_in([(k, v) for k, v in state_dict.items() if k in params])
        self.synchronize()

    def copy_to_module(self, module=None):
        """Copy the latest weights into the nn.Module this model was built from (or `module`,
        which must have the same structure; for a causal LM, a transformers model of the same
        architecture and sizes). Returns the module."""
        module = module if module is not None else self.model
        names = self._module_names
        if names is None and self._hf_config is not None and module is not None:
            names = {name: hf for name, hf, _ in self._hf_params()}
        if module is None or names is None:
            raise RoundPipeError(Status.STATE, "copy_to_module needs a model built from an "
                                 "nn.Module, or a module to copy into")
        targets = module_tensors(module)
        missing = [names[k] for k in names if names[k] not in targets]
        if missing:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "copy_to_module: the module has no "
                                 "parameter %s" % ", ".join(missing))
        with torch.no_grad():
            for name, value in self.state_dict().items():
                if name not in names:
                    continue
                target = targets[names[name]]
                target.copy_(value.to(target.dtype))
        return module

    def generate(self, input_ids: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        """Token generation of a Hugging Face causal LM, as transformers' ``generate()``
        (greedy or sampled; one forward pass per new token, no KV cache): see
        :func:`roundpipe.causal_lm.generate`."""
        if self._causal_lm is None:
            raise RoundPipeUnsupportedError("generate() needs a Hugging Face causal LM")
        return _generate(self, input_ids, **kwargs)

    def save_pretrained(self, save_directory, safe_serialization=True, **kwargs):
        """Save a causal LM as a Hugging Face directory that transformers' from_pretrained
        loads: config.json (its "dtype" set to the model dtype) and the latest weights
        (synchronizes first) in the model dtype under Hugging Face names, in the file layout of
        the checkpoint it was loaded from (one model.safetensors, or the same shards and index).
        The directory is created if missing (its parent must exist); tokenizer files are not
        written. Only for models built from a Hugging Face model, directory or config. With
        data parallelism only rank 0 writes (the other ranks' calls do nothing).

        A model with LoRA adapters saves what the object it was built from would save: built
        from a PEFT model, PEFT's adapter directory (that model's own save_pretrained, after
        :meth:`synchronize` wrote the trained adapters into it; `kwargs` go to it); otherwise
        the merged model (as :meth:`save_merged`). :meth:`save_lora` writes the adapters of
        either."""
        original = self._original_model
        if (self._hf_config is None or self._peft is not None) and \
                hasattr(original, "save_pretrained"):
            # a Python preset or a PEFT model (whose adapters synchronize() brings up to date):
            # the wrapped model saves itself, on data-parallel rank 0 only, as the engine's own
            # saves
            self.synchronize()
            if self._model.data_parallel()[0] != 0:
                return None
            return original.save_pretrained(save_directory,
                                            safe_serialization=safe_serialization, **kwargs)
        if not safe_serialization:
            raise RoundPipeUnsupportedError("save_pretrained writes safetensors only "
                                            "(safe_serialization=True)")
        if self._hf_config is None:
            raise RoundPipeError(Status.STATE, "save_pretrained needs a model built from a "
                                 "Hugging Face model, directory or config; use save(path)")
        self._model.call("model_save_hf", os.fsencode(os.fspath(save_directory)))

    def save_merged(self, save_directory):
        """Save a causal LM as a plain Hugging Face directory (``rp_model_save_hf``): with LoRA
        adapters, every adapted weight is merged, W + (lora_alpha / r) B A, rounded once to the
        model dtype; transformers' from_pretrained loads it without PEFT. Synchronizes first;
        with data parallelism only rank 0 writes."""
        if self._hf_config is None:
            raise RoundPipeError(Status.STATE, "save_merged needs a model built from a Hugging "
                                 "Face model, directory or config")
        self._model.call("model_save_hf", os.fsencode(os.fspath(save_directory)))

    def save_lora(self, save_directory, base_model=None):
        """Save the LoRA adapters in PEFT's format (``rp_model_save_lora``):
        adapter_config.json and adapter_model.safetensors (fp32 master weights), which
        ``PeftModel.from_pretrained(base, save_directory)`` and :meth:`load_lora` load.
        `base_model` is written as base_model_name_or_path; by default the directory the
        model was built from, or the PEFT model's own entry. Synchronizes first; with data
        parallelism only rank 0 writes."""
        if base_model is None and self._peft is not None:
            base_model = getattr(self.model.peft_config[self._peft.adapter],
                                 "base_model_name_or_path", None)
        elif base_model is None and self._hf_dir is not None:
            base_model = os.path.abspath(os.fspath(self._hf_dir))
        self._model.call("model_save_lora", os.fsencode(os.fspath(save_directory)),
                         os.fsencode(os.fspath(base_model)) if base_model is not None else None)

    def load_lora(self, directory):
        """Load LoRA adapters saved by :meth:`save_lora` or by PEFT's save_pretrained into the
        model's adapters (``rp_model_load_lora``). adapter_config.json must describe them (the
        same r, lora_alpha and target_modules; lora_dropout may differ) and
        adapter_model.safetensors hold exactly their tensors with their shapes; everything is
        checked before any weight changes (RoundPipeError naming the key or tensor).
        Synchronizes first; optimizer state is kept, accumulated gradients are dropped."""
        self._model.call("model_load_lora", os.fsencode(os.fspath(directory)))
        self._params.reattach_grads(self._model.handle.value)

    def load_pretrained(self, directory):
        """Load the weights of a Hugging Face directory (model.safetensors or sharded, with
        this model's architecture and sizes; its config.json is not read) into a causal LM.
        Every tensor is checked before any weight changes. Synchronizes first; optimizer state
        is kept, accumulated gradients are dropped; later save_pretrained calls use the file
        layout of `directory`."""
        if self._hf_config is None:
            raise RoundPipeError(Status.STATE, "load_pretrained needs a model built from a "
                                 "Hugging Face model, directory or config; use load(path)")
        self._model.call("model_load_hf", os.fsencode(os.fspath(directory)))
        self._params.reattach_grads(self._model.handle.value)
        self._module_frozen_stale = True

    def hf_parameter_name(self, name):
        """The Hugging Face tensor name of engine parameter `name` of a causal LM
        ("1.self_attn.q_proj.weight" -> "model.layers.0.self_attn.q_proj.weight"), as the
        engine names it (``rp_param_hf_name``; RoundPipeError STATE for other models)."""
        return self._model.param_hf_name(self._model.param_find(name))

    def _hf_params(self):
        """(engine name, Hugging Face name, shape) of every parameter, names from the engine."""
        return [(name, self._model.param_hf_name(i), tuple(p.shape))
                for i, (name, p) in enumerate(self._params.build())]

    def save(self, path):
        """Save the latest weights (model dtype, engine names) as safetensors (with data
        parallelism: on rank 0 only)."""
        self._model.call("model_save", os.fsencode(os.fspath(path)))

    def load(self, path):
        """Load every parameter from a safetensors file (drops accumulated gradients)."""
        self._model.call("model_load", os.fsencode(os.fspath(path)))
        self._params.reattach_grads(self._model.handle.value)
        self._module_frozen_stale = True
