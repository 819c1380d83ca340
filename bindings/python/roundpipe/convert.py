"""From what upstream users hand to RoundPipe (an ``nn.Module``, a Hugging Face model) to what
the engine takes (a JSON layer spec plus weights, or a Hugging Face config / directory)."""

import json
import os
import warnings

import torch
from torch import nn

from . import hf
from ._hf_presets import peft_base_model
from .errors import RoundPipeUnsupportedError
from .lora import peft_lora
from .hf import HF_ARCHITECTURES  # noqa: F401 (re-export)

SUPPORTED_MODULES = (
    "nn.Linear, nn.Embedding (no padding_idx/max_norm/sparse), nn.LayerNorm (1-d, affine with "
    "bias), nn.RMSNorm (1-d, affine), nn.ReLU, nn.SiLU, nn.Tanh, nn.GELU, nn.Dropout, "
    "nn.Flatten (end_dim=-1), nn.Identity (dropped), and nested nn.Sequential of these")

SUPPORTED_INPUTS = (
    "a JSON layer spec (dict, list of layer dicts, JSON text, or path of a .json file); any "
    "nn.Module (an nn.Sequential's children are the layers, any other module is one layer; "
    "the engine runs these itself: " + SUPPORTED_MODULES + ", every other module runs as a "
    "Python layer); or " + hf.SUPPORTED_HF)


class ConvertedModule:
    """Result of converting a module: the spec, (engine name, source parameter, module name)
    for every parameter of a built-in layer, in the engine's order, and the Python layers
    (caller-defined entries of the spec, in order)."""

    def __init__(self, spec, params, dtype, python_layers=(), runtime=None):
        self.spec = spec
        self.params = params
        self.dtype = dtype
        self.python_layers = list(python_layers)
        self.runtime = runtime  # the LayerRuntime the Python layers report to

    @property
    def first_is_python(self):
        return bool(self.python_layers) and self.python_layers[0].index == 0

    def module_names(self):
        """engine name -> module name of every tensor: built-in layers' parameters, Python
        layers' parameters and buffers."""
        names = {engine: mod for engine, _, mod in self.params}
        for layer in self.python_layers:
            for local in layer.param_names + layer.buffer_names:
                names["%d.%s" % (layer.index, local)] = \
                    "%s.%s" % (layer.name, local) if layer.name else local
        return names


def _flatten(module, prefix):
    """(qualified name, leaf module) for every leaf of nested Sequentials."""
    if isinstance(module, nn.Sequential):
        for name, child in module.named_children():
            yield from _flatten(child, prefix + name + ".")
    else:
        yield prefix[:-1] if prefix else "", module


def _layer_spec(name, m):
    """(layer dict or None to drop, [(layer param name, module param name)])."""
    where = "module %r (%s)" % (name or "<root>", type(m).__name__)

    def refuse(why):
        raise RoundPipeUnsupportedError(
            "%s: %s. Supported: %s; as the whole model: Hugging Face %s."
            % (where, why, SUPPORTED_MODULES, " / ".join(HF_ARCHITECTURES)))

    if isinstance(m, nn.Linear):
        spec = {"type": "linear", "in": m.in_features, "out": m.out_features,
                "bias": m.bias is not None}
        return spec, [("weight", "weight")] + ([("bias", "bias")] if m.bias is not None else [])
    if isinstance(m, nn.Embedding):
        if m.padding_idx is not None or m.max_norm is not None or m.sparse:
            refuse("padding_idx, max_norm and sparse are not supported")
        return {"type": "embedding", "num": m.num_embeddings, "dim": m.embedding_dim}, \
            [("weight", "weight")]
    if isinstance(m, nn.LayerNorm):
        if len(m.normalized_shape) != 1:
            refuse("only a 1-d normalized_shape is supported")
        if not m.elementwise_affine or m.bias is None:
            refuse("only elementwise_affine=True with bias is supported")
        return {"type": "layer_norm", "dim": m.normalized_shape[0], "eps": float(m.eps)}, \
            [("weight", "weight"), ("bias", "bias")]
    if hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm):
        if len(m.normalized_shape) != 1:
            refuse("only a 1-d normalized_shape is supported")
        if not m.elementwise_affine:
            refuse("only elementwise_affine=True is supported")
        # eps=None means the float32 machine epsilon in torch (weights computed in fp32 here).
        eps = m.eps if m.eps is not None else torch.finfo(torch.float32).eps
        return {"type": "rms_norm", "dim": m.normalized_shape[0], "eps": float(eps)}, \
            [("weight", "weight")]
    for cls, typ in ((nn.ReLU, "relu"), (nn.SiLU, "silu"), (nn.Tanh, "tanh")):
        if type(m) is cls:
            return {"type": typ}, []
    if type(m) is nn.GELU:
        return {"type": "gelu", "approximate": m.approximate}, []
    if type(m) is nn.Dropout:
        if not 0.0 <= m.p < 1.0:
            refuse("p must be in [0, 1)")
        return {"type": "dropout", "p": float(m.p)}, []
    if type(m) is nn.Flatten:
        if m.end_dim != -1:
            refuse("only end_dim=-1 is supported")
        if m.start_dim < 1:
            refuse("start_dim must be >= 1 (the batch dimension stays)")
        return {"type": "flatten", "start_dim": m.start_dim}, []
    if type(m) is nn.Identity:
        return None, []
    if hf.hf_architecture(m) is not None:
        refuse("a Hugging Face model can only be the whole model (RoundPipe(model) or "
               "wrap_model_to_roundpipe(model)), not one layer of an nn.Sequential")
    refuse("this module type has no engine layer")


def _builtin_spec(qual, leaf):
    """(layer dict or None to drop, names) of a module the engine runs itself, or False for
    one that runs as a Python layer (no engine layer, or one with frozen parameters: every
    built-in layer's parameters are trainable)."""
    if any(not p.requires_grad for p in leaf.parameters()):
        return False
    try:
        return _layer_spec(qual, leaf)
    except RoundPipeUnsupportedError:
        return False


def convert_module(module, python_layers=True):
    """Convert an nn.Sequential (its children, nested Sequentials flattened, are the layers)
    or any other module (one layer) to a spec and its weights. Children the engine implements
    are built-in layers; every other child runs as a Python layer (`python_layers`; else it is
    refused, naming what the engine implements)."""
    if not isinstance(module, nn.Module):
        raise TypeError("expected an nn.Module, got %r" % type(module).__name__)
    from ._python_layer import LayerRuntime, PythonLayer
    runtime = LayerRuntime()
    entries = []  # (qual, leaf, spec and names, or False for a Python layer)
    for qual, leaf in _flatten(module, ""):
        built = _builtin_spec(qual, leaf) if python_layers else _layer_spec(qual, leaf)
        if built is not False and built[0] is None:
            continue  # nn.Identity
        entries.append((qual, leaf, built))
    if not entries:
        raise RoundPipeUnsupportedError("the module has no layer to run (an empty "
                                        "nn.Sequential, or only nn.Identity)")
    layers, params, pylayers = [], [], []
    dtypes = set()
    for index, (qual, leaf, built) in enumerate(entries):
        if built is False:
            layer = PythonLayer(leaf, index, qual, runtime, first=index == 0,
                                after_builtin=index > 0 and entries[index - 1][2] is not False,
                                before_builtin=index + 1 < len(entries)
                                and entries[index + 1][2] is not False)
            layers.append({"type": "caller", "def": len(pylayers)})
            pylayers.append(layer)
            dtypes.update(p.dtype for p in leaf.parameters() if p.is_floating_point())
            continue
        spec, names = built
        layers.append(spec)
        for layer_name, module_name in names:
            p = getattr(leaf, module_name)
            dtypes.add(p.dtype)
            full = "%s.%s" % (qual, module_name) if qual else module_name
            params.append(("%d.%s" % (index, layer_name), p, full))
    dtype = dtypes.pop() if len(dtypes) == 1 else (torch.float32 if not dtypes else None)
    if dtype is None:
        raise RoundPipeUnsupportedError("the module mixes parameter dtypes (%s); convert it to "
                                        "one dtype first" % ", ".join(sorted(map(str, dtypes))))
    return ConvertedModule({"layers": layers}, params, dtype, pylayers, runtime)


class ModelSource:
    """What RoundPipe(model) builds from. `kind`:
    - "spec": `text` is a JSON layer spec (rp_model_create);
    - "module": `text` is the spec of `converted` (an nn.Module), whose weights are copied in;
    - "hf_config": `text` is a Hugging Face config.json text (rp_model_create_from_hf_config,
      random weights), and `module` the transformers model whose weights are copied in, if any;
    - "hf_dir": `path` is a Hugging Face directory with weights (rp_model_create_from_hf).
    `dtype` is the model dtype the source suggests (None: the engine's default, float32).
    `peft`: for a PEFT model of a native architecture (then `module`), its
    :class:`~roundpipe.lora.PeftLora`, whose adapters the engine holds."""

    def __init__(self, kind, text=None, converted=None, module=None, path=None, dtype=None,
                 config=None, peft=None):
        self.layer_defs = []  # rp_layer_def owners of the Python layers, while building
        self.kind = kind
        self.text = text
        self.converted = converted
        self.module = module
        self.path = path
        self.dtype = dtype
        self.config = config  # the Hugging Face config dict (hf_* kinds)
        self.peft = peft

    @property
    def is_hf(self):
        return self.kind in ("hf_config", "hf_dir")


def _module_dtype(module):
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) > 1:
        raise RoundPipeUnsupportedError("the module mixes parameter dtypes (%s); convert it to "
                                        "one dtype first" % ", ".join(sorted(map(str, dtypes))))
    return dtypes.pop() if dtypes else None


def _hf_module_source(module, arch, peft_model=None):
    """The source of transformers model `module`; of `peft_model` around it when given (its
    adapters become the engine's, lora.peft_lora)."""
    config = getattr(module, "config", None)
    if config is None or not hf.is_hf_config_object(config):
        raise RoundPipeUnsupportedError("%s has no transformers config (.config); Supported: %s."
                                        % (type(module).__name__, hf.SUPPORTED_HF))
    config = hf.config_dict(config, arch)
    if peft_model is None:
        return ModelSource("hf_config", text=json.dumps(config), module=module,
                           dtype=_module_dtype(module), config=config)
    try:
        peft = peft_lora(peft_model, module)
    except RoundPipeUnsupportedError as exc:
        raise RoundPipeUnsupportedError(
            "this PEFT model has no native form (%s); wrap_model_to_roundpipe(model) runs it "
            "with transformers' and PEFT's modules as Python layers" % exc.message) from None
    if peft.frozen_adapters:
        # PeftModel.from_pretrained(..., is_trainable=False); the engine's adapters are always
        # trainable, and only the caller knows whether it will step them
        warnings.warn("the PEFT model's adapters are frozen (inference mode); RoundPipe's are "
                      "trainable: step() would train them", stacklevel=4)
    return ModelSource("hf_config", text=json.dumps(config), module=peft_model, dtype=peft.dtype,
                       config=config, peft=peft)


def _hf_config_source(config):
    config = hf.config_dict(config)
    return ModelSource("hf_config", text=json.dumps(config), dtype=hf.config_dtype(config),
                       config=config)


def resolve_model(model):
    """The ModelSource of what RoundPipe() was given."""
    if isinstance(model, nn.Module):
        arch = hf.hf_architecture(model)
        if arch is not None:
            return _hf_module_source(model, arch)
        base = peft_base_model(model)
        if base is not None and hf.hf_architecture(base) is not None:
            return _hf_module_source(base, hf.hf_architecture(base), model)
        converted = convert_module(model)
        return ModelSource("module", text=json.dumps(converted.spec), converted=converted,
                           dtype=converted.dtype)
    if hf.is_hf_config_dict(model) or hf.is_hf_config_object(model):
        return _hf_config_source(model)
    if isinstance(model, dict):
        return ModelSource("spec", text=json.dumps(model))
    if isinstance(model, (list, tuple)):
        return ModelSource("spec", text=json.dumps({"layers": list(model)}))
    if isinstance(model, (str, bytes, os.PathLike)):
        text = os.fsdecode(model) if not isinstance(model, str) else model
        if text.lstrip().startswith("{"):
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None  # the engine reports the JSON error
            if hf.is_hf_config_dict(parsed):
                return _hf_config_source(parsed)
            return ModelSource("spec", text=text)
        if os.path.isdir(text):
            if os.path.exists(os.path.join(text, "config.json")):
                config, has_weights = hf.hf_directory(text)
                if has_weights:
                    return ModelSource("hf_dir", path=text, dtype=hf.config_dtype(config),
                                       config=config)
                return _hf_config_source(config)
            raise RoundPipeUnsupportedError("%r is a directory without config.json. Supported: %s."
                                            % (text, SUPPORTED_INPUTS))
        if os.path.isfile(text):
            with open(text, "r", encoding="utf-8") as f:
                content = f.read()
            try:
                parsed = json.loads(content)
            except ValueError:
                parsed = None
            if hf.is_hf_config_dict(parsed):
                return _hf_config_source(parsed)
            return ModelSource("spec", text=content)
        raise RoundPipeUnsupportedError("%r is neither JSON text nor an existing file or "
                                        "directory. Supported: %s." % (text, SUPPORTED_INPUTS))
    raise RoundPipeUnsupportedError("cannot build a RoundPipe model from %s. Supported: %s."
                                    % (type(model).__name__, SUPPORTED_INPUTS))
