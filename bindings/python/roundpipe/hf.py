"""Hugging Face causal LMs (Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM) for the
engine.

The engine builds these models itself from a config.json text (``rp_model_create_from_hf_config``)
or a model directory (``rp_model_create_from_hf``), as the layer list token_embedding,
num_hidden_layers x decoder_layer (moe_decoder_layer for Qwen3-MoE's sparse layers), rms_norm,
lm_head (docs/semantics.md). This module decides
which of those a Python object asks for, matches a transformers model's tensors to the engine's
parameters (by the Hugging Face names the engine gives them, ``rp_param_hf_name``), and turns the
keyword inputs of a Hugging Face forward call into the engine's positional inputs.

transformers is never imported here: a transformers model is recognised by its class names and
read through ``config.to_json_string`` and ``state_dict``.
"""

import json
import os
import warnings

import torch

from .errors import RoundPipeUnsupportedError

HF_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM")
_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "llama": "LlamaForCausalLM"}

#: The engine's inputs of a causal LM, in order (input 0, 1, 2).
HF_INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}

# Weight files transformers may write that the engine cannot read (safetensors only).
_OTHER_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5",
                       "flax_model.msgpack", "model.ckpt.index")

SUPPORTED_HF = (
    "Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM / LlamaForCausalLM as a transformers "
    "model object (or a PEFT LoRA model of one, get_peft_model), a model directory (config.json "
    "with model.safetensors or model.safetensors.index.json; config.json alone gives random "
    "weights), or a config (a dict or JSON text with \"architectures\", or a "
    "transformers config object)")


def hf_architecture(obj):
    """The supported architecture a transformers model object is (its class or a base class),
    else None."""
    for cls in type(obj).__mro__:
        if cls.__name__ in HF_ARCHITECTURES:
            return cls.__name__
    return None


def is_hf_config_dict(d):
    """A dict that is a Hugging Face config (not a layer spec)."""
    return isinstance(d, dict) and "layers" not in d and ("architectures" in d or
                                                          "model_type" in d)


def is_hf_config_object(obj):
    """A transformers PretrainedConfig (duck-typed: to_json_string and model_type)."""
    return (not isinstance(obj, (dict, str, bytes)) and hasattr(obj, "to_json_string")
            and hasattr(obj, "model_type"))


def config_dict(config, architecture=None):
    """A Hugging Face config (dict, JSON text or transformers config object) as a dict whose
    "architectures" names exactly one architecture: `architecture` when given (the class of a
    model object wins over what its config says), else the config's own, else the one its
    "model_type" implies."""
    if is_hf_config_object(config):
        # use_diff=False: every value, not just those differing from transformers' defaults
        # (the engine does not know transformers' defaults of every version).
        config = json.loads(config.to_json_string(use_diff=False))
    elif isinstance(config, (str, bytes)):
        config = json.loads(config)
    elif isinstance(config, dict):
        config = dict(config)
    else:
        raise TypeError("a Hugging Face config must be a dict, JSON text or a transformers "
                        "config, got %s" % type(config).__name__)
    if architecture is None and not config.get("architectures"):
        architecture = _MODEL_TYPES.get(config.get("model_type"))
        if architecture is None:
            raise RoundPipeUnsupportedError(
                "the Hugging Face config names no architecture and model_type %r is not one the "
                "engine has (%s). Supported: %s."
                % (config.get("model_type"), ", ".join(sorted(_MODEL_TYPES)), SUPPORTED_HF))
    if architecture is not None:
        config["architectures"] = [architecture]
    return config


def config_dtype(config):
    """The dtype a config.json says its weights are in ("dtype", or the older "torch_dtype"), as
    transformers' from_pretrained(dtype="auto") reads it; None when absent or not a float type
    the engine computes in."""
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPE_NAMES.get(name) if isinstance(name, str) else None


def hf_directory(path):
    """(config dict, has_weights) of a Hugging Face model directory. Raises
    RoundPipeUnsupportedError when its weights are in a format the engine cannot read."""
    with open(os.path.join(path, "config.json"), "r", encoding="utf-8") as f:
        try:
            config = json.load(f)
        except ValueError as exc:
            raise RoundPipeUnsupportedError("%s: config.json is not valid JSON (%s). Supported: "
                                            "%s." % (path, exc, SUPPORTED_HF)) from None
    if not isinstance(config, dict):
        raise RoundPipeUnsupportedError("%s: config.json is not a JSON object" % path)
    has_weights = any(os.path.exists(os.path.join(path, name)) for name in
                      ("model.safetensors", "model.safetensors.index.json"))
    if not has_weights:
        other = [name for name in _OTHER_WEIGHT_FILES if os.path.exists(os.path.join(path, name))]
        if other:
            raise RoundPipeUnsupportedError(
                "%s holds its weights as %s; the engine reads safetensors only (model.safetensors "
                "or model.safetensors.index.json): load it in transformers and save_pretrained() "
                "it again, or pass the transformers model to wrap_model_to_roundpipe()"
                % (path, ", ".join(other)))
        warnings.warn("%s has config.json but no model.safetensors: the weights are initialised "
                      "randomly from the seed" % path, stacklevel=4)
    return config, has_weights


def module_weights(module, engine_params, tied, state_name=None):
    """(engine name, source tensor, module parameter name) for every parameter of
    `engine_params`, taken from the transformers model's state dict by Hugging Face name.
    `engine_params` holds (engine name, Hugging Face name, shape) of each parameter, the names
    as the engine gives them (``rp_param_hf_name``); `state_name(hf_name)` is the module's
    state-dict name of a Hugging Face name where they differ (a PEFT model's, roundpipe.lora).
    Raises RoundPipeUnsupportedError, before anything is copied, when a tensor is missing or of
    another shape, or when the module holds tensors the engine's model has no place for
    (adapters the engine lacks, extra heads)."""
    state = module.state_dict()
    local = state_name or (lambda name: name)
    out, used, problems = [], set(), []
    for engine_name, hf_name, shape in engine_params:
        name = local(hf_name)
        tensor = state.get(name)
        if tensor is None:
            problems.append("%s (engine %s) is missing" % (name, engine_name))
        elif tuple(tensor.shape) != tuple(shape):
            problems.append("%s has shape %s, the engine's %s is %s"
                            % (name, tuple(tensor.shape), engine_name, tuple(shape)))
        else:
            out.append((engine_name, tensor, name))
        used.add(name)
    head_name = local("lm_head.weight")
    if tied and head_name in state:
        head, embed = state[head_name], state.get(local("model.embed_tokens.weight"))
        if embed is not None and head.data_ptr() != embed.data_ptr() and \
                not torch.equal(head, embed):
            problems.append("tie_word_embeddings is true but lm_head.weight differs from "
                            "model.embed_tokens.weight")
        used.add(head_name)
    extra = sorted(k for k in state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        shown = ", ".join(extra[:8]) + (", ..." if len(extra) > 8 else "")
        problems.append("the module holds tensors the engine's model has not: %s (merge or "
                        "remove adapters and extra heads first)" % shown)
    if problems:
        raise RoundPipeUnsupportedError("cannot copy the weights of %s: %s"
                                        % (type(module).__name__, "; ".join(problems)))
    return out


def hf_inputs(args, kwargs):
    """The inputs of a call on a causal LM in the engine's order (input_ids, attention_mask,
    position_ids), keeping the caller's positional / keyword structure: positional arguments
    fill those names in order, keywords follow in that order. None entries are dropped; a bool
    mask becomes int64; position ids without a mask get an all-ones mask (input 1 must exist for
    input 2 to be seen)."""
    args = tuple(args)
    kwargs = dict(kwargs or {})
    if len(args) > len(HF_INPUT_NAMES):
        raise TypeError("a causal LM takes at most %d positional inputs (%s), got %d"
                        % (len(HF_INPUT_NAMES), ", ".join(HF_INPUT_NAMES), len(args)))
    unknown = [k for k in kwargs if k not in HF_INPUT_NAMES]
    if unknown:
        hint = " (pass labels to forward_backward(label=...))" if "labels" in unknown else ""
        raise RoundPipeUnsupportedError(
            "keyword inputs %s are not supported by the engine's causal LM%s. Supported: %s"
            % (", ".join(map(repr, unknown)), hint, ", ".join(HF_INPUT_NAMES)))
    values = dict(zip(HF_INPUT_NAMES, args))
    twice = [k for k in kwargs if k in values]
    if twice:
        raise TypeError("inputs given both positionally and by keyword: %s" % ", ".join(twice))
    values.update(kwargs)
    values = {k: v for k, v in values.items() if v is not None}
    if "input_ids" not in values:
        raise TypeError("a causal LM needs input_ids (token ids [batch, seq])")
    mask = values.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        values["attention_mask"] = mask.to(torch.int64)  # the engine takes integer masks
    if "position_ids" in values and "attention_mask" not in values:
        ids = values["input_ids"]
        values["attention_mask"] = torch.ones(ids.shape, dtype=torch.int64, device=ids.device)
    names = [n for n in HF_INPUT_NAMES if n in values]
    n_positional = 0
    while n_positional < min(len(args), len(names)) and \
            names[n_positional] == HF_INPUT_NAMES[n_positional] and args[n_positional] is not None:
        n_positional += 1
    new_args = tuple(values[n] for n in names[:n_positional])
    new_kwargs = {n: values[n] for n in names[n_positional:]}
    return new_args, new_kwargs
