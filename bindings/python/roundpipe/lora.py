"""LoRA adapters on the engine's native Hugging Face decoder layers (docs/lora.md).

The engine holds the adapters itself (``rp_model_options_set_lora``): each adapted projection
``y = x W^T`` of every decoder layer gains ``(lora_alpha / r) * B A dropout(x)``, and every other
parameter is frozen, held once in the model dtype. This module turns what users hand over into
those options, refusing by name what the engine cannot express:

- :class:`LoraConfig` (PEFT's field names), a dict of its fields, or a ``peft.LoraConfig``
  (read through its attributes) for ``RoundPipe(model, lora=...)``;
- a PEFT model (``get_peft_model(qwen3_or_llama, LoraConfig(...))``): its adapters are read from
  its modules, and :func:`peft_state_name` says where each engine tensor lives in it, so that
  its weights are copied in and the trained adapters copied back by ``synchronize()``.

peft is never imported: its models and configs are recognised by their attributes, as
transformers' are in :mod:`roundpipe.hf`. Which projections the engine can adapt is the engine's
to say (``rp_model_options_set_lora`` names an unknown one); the layout of a PEFT model's names
is PEFT's, written here once.
"""

import dataclasses
import re
from typing import Callable, List, Optional, Sequence, Union

from torch import nn

from .errors import RoundPipeUnsupportedError

__all__ = ["LoraConfig"]


@dataclasses.dataclass
class LoraConfig:
    """The LoRA adapters of a native Hugging Face model, with ``peft.LoraConfig``'s field names
    and defaults.

    Args:
        r: rank of every adapter (>= 1).
        lora_alpha: the adapters' output is scaled by ``lora_alpha / r``.
        lora_dropout: dropout on the adapters' input in training calls, in [0, 1).
        target_modules: the adapted projections of every decoder layer: a list of names among
            q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or ``"all-linear"``
            (all seven); None: PEFT's default for Llama and Qwen3, q_proj and v_proj.

    ``RoundPipe.lora`` gives the engine's answer in this shape, its ``target_modules`` the
    adapted projections as a list in layer order.
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: Optional[Union[str, Sequence[str]]] = None

    def engine_values(self):
        """(rank, alpha, dropout, target_modules bytes) for ``rp_model_options_set_lora``; the
        engine checks the ranges and the module names."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError("LoraConfig.r must be an integer >= 1 (lora=None for no adapters), "
                             "got %r" % (self.r,))
        targets = self.target_modules
        if targets is None:
            text = ""
        elif isinstance(targets, str):
            if targets != "all-linear":
                raise RoundPipeUnsupportedError(
                    "target_modules=%r: a string is a regular expression in PEFT, which the "
                    "engine's adapters cannot follow; give a list of projection names (q_proj, "
                    "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or \"all-linear\""
                    % targets)
            text = targets
        else:
            text = ",".join(str(name) for name in targets)
        return int(self.r), float(self.lora_alpha), float(self.lora_dropout), text.encode()


# Fields of peft.LoraConfig the engine follows (the first four), and those that change nothing
# it computes (bookkeeping, and settings that act only together with a refused feature).
_EXPRESSED = ("r", "lora_alpha", "lora_dropout", "target_modules")
_HARMLESS = ("task_type", "peft_type", "auto_mapping", "peft_version",
             "base_model_name_or_path", "revision", "inference_mode", "runtime_config",
             "megatron_core", "qalora_group_size", "ensure_weight_tying")

# Why a field set away from its default is refused: the engine's adapters are plain LoRA
# (A, B, alpha / r scaling, no bias) on the same projections of every decoder layer, and train
# nothing else.
_WHY = {
    "use_dora": "DoRA (a magnitude vector per adapted weight) is not plain LoRA",
    "use_rslora": "rsLoRA scales by alpha / sqrt(r); the engine scales by alpha / r",
    "rank_pattern": "every adapter has the same rank",
    "alpha_pattern": "every adapter has the same alpha",
    "layers_to_transform": "every decoder layer is adapted",
    "layers_pattern": "every decoder layer is adapted",
    "exclude_modules": "the target projections of every decoder layer are adapted",
    "modules_to_save": "only the adapters train (no fully trained extra modules)",
    "trainable_token_indices": "only the adapters train (no trainable token embeddings)",
    "bias": "adapted layers' biases stay frozen (bias=\"none\")",
    "lora_bias": "lora_B has no bias",
    "fan_in_fan_out": "the projections are nn.Linear (fan_in_fan_out=False)",
    "layer_replication": "the decoder layers are the base model's own",
    "target_parameters": "adapters are on projection modules, not on parameters",
}


def _peft_type_is_lora(config):
    peft_type = getattr(config, "peft_type", None)
    return peft_type is None or str(getattr(peft_type, "value", peft_type)) == "LORA"


def _defaults(config):
    """The default of every field of a dataclass config (``type(config)()``), else None."""
    if not dataclasses.is_dataclass(config):
        return None
    try:
        return type(config)()
    except Exception:  # noqa: BLE001 - a config class that needs arguments: no defaults
        return None


def _is_default(config, defaults, field):
    value = getattr(config, field, None)
    if defaults is not None:
        return value == getattr(defaults, field, None)
    return value in (None, False, {}, [], (), "none")


def lora_from_peft_config(config, weights_given=False):
    """The :class:`LoraConfig` of a ``peft.LoraConfig`` (read through its attributes). Raises
    RoundPipeUnsupportedError naming the first field the engine cannot follow. With
    `weights_given` (a PEFT model's adapters are copied in) ``init_lora_weights`` does not
    matter; otherwise it must be PEFT's default, which is the engine's initialisation."""
    if not _peft_type_is_lora(config):
        raise RoundPipeUnsupportedError("peft_type %s: the engine's adapters are LoRA"
                                        % getattr(config, "peft_type", None))
    defaults = _defaults(config)
    fields = [f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config) \
        else list(_WHY) + ["init_lora_weights"]
    for field in fields:
        if field in _EXPRESSED or field in _HARMLESS or _is_default(config, defaults, field):
            continue
        if field == "init_lora_weights":
            if weights_given or getattr(config, field) is True:
                continue
            raise RoundPipeUnsupportedError(
                "LoraConfig.init_lora_weights=%r: the engine initialises adapters as PEFT's "
                "default (True: A uniform, B zero); load other starting adapters with "
                "load_lora(dir)" % (getattr(config, field),))
        raise RoundPipeUnsupportedError(
            "LoraConfig.%s=%r has no native form: %s" % (
                field, getattr(config, field),
                _WHY.get(field, "the engine's adapters are plain LoRA on the decoder layers")))
    return LoraConfig(r=config.r, lora_alpha=config.lora_alpha,
                      lora_dropout=config.lora_dropout, target_modules=config.target_modules)


def lora_config(value):
    """`value` (None, a :class:`LoraConfig`, a dict of its fields, or a ``peft.LoraConfig``) as
    a LoraConfig or None."""
    if value is None or isinstance(value, LoraConfig):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(LoraConfig)})
        if unknown:
            raise TypeError("lora: unknown keys %s; LoraConfig has r, lora_alpha, lora_dropout, "
                            "target_modules" % ", ".join(map(repr, unknown)))
        return LoraConfig(**value)
    if hasattr(value, "r") and hasattr(value, "lora_alpha"):
        return lora_from_peft_config(value)
    raise TypeError("lora must be a roundpipe.LoraConfig, a dict of its fields or a "
                    "peft.LoraConfig, got %s" % type(value).__name__)


def lora_of_engine(rank, alpha, dropout, targets):
    """What ``rp_model_lora`` answered, as a LoraConfig (None: no adapters)."""
    if rank == 0:
        return None
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=[t for t in targets.split(",") if t])


# ------------------------------------------------------------------------------------------------
# PEFT models
# ------------------------------------------------------------------------------------------------

# A module of decoder layer <i>: model.layers.<i>.<path>.<name> (named as transformers' Qwen3
# and Llama name them; <name> is what PEFT's target_modules match).
_DECODER_MODULE = re.compile(r"model\.layers\.(\d+)\.(.+)\.([^.]+)")


class PeftLora:
    """A PEFT model whose adapters the engine can hold: `config` (the engine's settings),
    `adapter` (its adapter name), `prefix` (where the transformers model sits in it,
    "base_model.model."), `dtype` (of its base weights), `frozen_adapters` (PEFT does not
    train them: loaded for inference)."""

    def __init__(self, config, adapter, prefix, dtype, frozen_adapters):
        self.config = config
        self.adapter = adapter
        self.prefix = prefix
        self.dtype = dtype
        self.frozen_adapters = frozen_adapters


def _is_lora_layer(module):
    return hasattr(module, "lora_A") and hasattr(module, "lora_B") and \
        hasattr(module, "base_layer")


def peft_lora(model, base):
    """The :class:`PeftLora` of PEFT model `model` around transformers model `base`. Raises
    RoundPipeUnsupportedError saying what the engine's adapters cannot express: several
    adapters, a config field (:func:`lora_from_peft_config`), adapters outside the decoder
    layers or not on the same projections of every layer, merged or disabled adapters, other
    trainable parameters."""
    configs = dict(getattr(model, "peft_config", None) or {})
    if len(configs) != 1:
        raise RoundPipeUnsupportedError("the PEFT model has %d adapters (%s); the engine holds "
                                        "one" % (len(configs), ", ".join(configs)))
    (adapter, config), = configs.items()
    settings = lora_from_peft_config(config, weights_given=True)
    prefix = next((name + "." for name, m in model.named_modules() if m is base), None)
    if prefix is None:
        raise RoundPipeUnsupportedError("the PEFT model's base model is not one of its modules")

    adapted, adapter_params = {}, set()  # layer index -> projection names
    for name, module in base.named_modules():
        if not _is_lora_layer(module):
            continue
        where = _DECODER_MODULE.fullmatch(name)
        if where is None:
            raise RoundPipeUnsupportedError("an adapter on %s: the engine adapts projections "
                                            "of the decoder layers only" % name)
        if not isinstance(module.base_layer, nn.Linear) or adapter not in module.lora_A:
            raise RoundPipeUnsupportedError("%s is a %s over %s; the engine adapts nn.Linear "
                                            "projections" % (name, type(module).__name__,
                                                             type(module.base_layer).__name__))
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            raise RoundPipeUnsupportedError(
                "the adapter of %s is %s; the engine adds it to the frozen weight itself"
                % (name, "merged into the base weight (unmerge_adapter() first)"
                   if getattr(module, "merged", False) else "disabled"))
        r = module.r.get(adapter)
        scaling = module.scaling.get(adapter)
        if r != settings.r or abs(scaling - settings.lora_alpha / settings.r) > 1e-12 * scaling:
            raise RoundPipeUnsupportedError(
                "the adapter of %s has r=%s and scaling %s; every adapter of the engine has "
                "r=%s and scaling lora_alpha / r = %s" % (name, r, scaling, settings.r,
                                                          settings.lora_alpha / settings.r))
        adapted.setdefault(int(where.group(1)), set()).add(where.group(3))
        for holder in (module.lora_A[adapter], module.lora_B[adapter]):
            adapter_params.update(id(p) for p in holder.parameters())

    n_layers = getattr(getattr(base, "config", None), "num_hidden_layers", None)
    targets = adapted.get(0, set())
    uneven = [i for i in range(n_layers or len(adapted)) if adapted.get(i, set()) != targets]
    if not targets or uneven:
        raise RoundPipeUnsupportedError(
            "the PEFT model adapts %s; the engine adapts the same projections of every decoder "
            "layer" % ("nothing" if not adapted else ", ".join(
                "layer %d: %s" % (i, ", ".join(sorted(adapted.get(i, ())) or ["none"]))
                for i in sorted(set(adapted) | set(uneven)))))
    others = [name for name, p in base.named_parameters()
              if p.requires_grad and id(p) not in adapter_params]
    if others:
        raise RoundPipeUnsupportedError("the PEFT model trains %s besides its adapters; the "
                                        "engine trains the adapters only" % ", ".join(others[:4]))
    frozen_adapters = any(not p.requires_grad for _, p in base.named_parameters()
                          if id(p) in adapter_params)
    settings.target_modules = sorted(targets)
    dtypes = {p.dtype for p in base.parameters() if id(p) not in adapter_params}
    if len(dtypes) != 1:
        raise RoundPipeUnsupportedError("the base model mixes parameter dtypes (%s); convert "
                                        "it to one dtype first" % ", ".join(map(str, dtypes)))
    return PeftLora(settings, adapter, prefix, dtypes.pop(), frozen_adapters)


def peft_state_name(hf_names: List[str], peft: PeftLora) -> Callable[[str], str]:
    """The function giving the PEFT model's state-dict name of a Hugging Face tensor name, for a
    model whose engine tensors have `hf_names`: "model.layers.0.self_attn.q_proj.weight" ->
    "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" for an adapted
    projection, "...q_proj.lora_A.weight" -> "...q_proj.lora_A.default.weight"; other names only
    gain the prefix."""
    adapted = {name.rsplit(".lora_A.", 1)[0] for name in hf_names if ".lora_A." in name}

    def state_name(name):
        module, _, leaf = name.rpartition(".")
        if module.endswith((".lora_A", ".lora_B")):
            return "%s%s.%s.%s" % (peft.prefix, module, peft.adapter, leaf)
        if module in adapted:
            return "%s%s.base_layer.%s" % (peft.prefix, module, leaf)
        return peft.prefix + name

    return state_name
