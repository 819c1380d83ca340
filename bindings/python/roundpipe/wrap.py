"""wrap_model_to_roundpipe: upstream's automatic entry point.

Presets first (the engine's native Qwen3 / Qwen3-MoE / Llama, PEFT LoRA models of them
included; Python Sequential presets of transformers' own modules for other causal LMs,
_hf_presets), then upstream's recursion over the module tree
(API_model "Wrapping Strategy Details"): skip_modules, nn.Sequential, the own-parameter and size
thresholds, nn.ModuleList element-wise, recursion into children; a root that could not be
wrapped whole becomes an :class:`AutoRoundPipe`.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from typing import Any, Container, Dict, Iterator, List, Optional, Union

import torch
from torch import nn

from ._args import call_site_name, parse_devices, parse_host_memory
from ._hf_presets import peft_base_model, sequential_preset
from .causal_lm import CausalLM
from .config import RoundPipeRunConfig
from .distributed import parse_data_parallel
from .errors import RoundPipeUnsupportedError
from .hf import HF_ARCHITECTURES, hf_architecture
from .lora import peft_lora
from .model import RoundPipe
from .optim import BuiltinOptimizer


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _has_own_forward(module):
    return type(module).forward is not nn.Module.forward


class RoundPipeModule(nn.Module):
    """A RoundPipe standing where a submodule was, inside a module that upstream's recursion
    could not wrap whole: calling it runs the RoundPipe's forward (inference)."""

    def __init__(self, roundpipe: RoundPipe) -> None:
        super().__init__()
        object.__setattr__(self, "roundpipe", roundpipe)  # not a submodule: no parameters

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.roundpipe.forward(*args, **kwargs)


class AutoRoundPipe:
    """Upstream's AutoRoundPipe: `model` with its large submodules replaced by RoundPipes, its
    own forward running on the calling thread. As upstream it has RoundPipe's forward and
    optimizer features but no fused forward_backward:

    - forward() in training mode (``train()``, the default) with gradients enabled connects
      every inner RoundPipe to autograd (their forward()), so ``loss.backward()`` trains them and
      the parameters the root kept for itself (modules left unwrapped: skip_modules, small ones
      recursed into), which torch's autograd fills as usual; ``eval()`` or ``torch.no_grad()``
      is inference.
    - optim_parameters() / parameters() are the root's own parameters, then every inner
      RoundPipe's optimizer parameters in the model's order (torch's order when the root's own
      are its direct parameters); optim_named_parameters() / named_parameters() name the root's
      as `model` does and an inner RoundPipe's by its place in `model` and then its layer
      ("encoder.0.weight", "blocks.1.0.weight").
    - step(step_fn) runs step_fn once per step, with every inner RoundPipe inside its step (its
      parameters' ``.grad`` that step's gradients), so one torch optimizer over
      optim_parameters() updates them all. is_async as RoundPipe.step with one inner RoundPipe
      and no parameters of the root's own; otherwise the step completes before step() returns
      (the inner steps are entered from the first one's optimizer thread, which must not race
      the caller's next forward through the others, and step_fn would update the root's
      parameters while that forward read them). A built-in optimizer
      steps each inner RoundPipe (refused when the root has trainable parameters of its own: it
      updates the engine's parameters only). A step an inner RoundPipe skips (inf / nan
      gradients, no GradScaler) skips step_fn, and every gradient of that step is dropped.
    - synchronize(), train(), eval(), close(); other attributes are `model`'s.
    """

    def __init__(self, model: nn.Module, inner: List[RoundPipe],
                 inner_paths: Optional[List[str]] = None) -> None:
        self.model = model
        self.roundpipes = inner
        # where each inner RoundPipe sits in `model` ("encoder", "blocks.0"): parameter names
        self._paths = list(inner_paths or [""] * len(inner))

    def __getattr__(self, name: str) -> Any:  # only for names not found on the instance
        return getattr(object.__getattribute__(self, "model"), name)

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> "AutoRoundPipe":
        self.model.train(mode)
        for rp in self.roundpipes:
            rp.train(mode)
        return self

    def eval(self) -> "AutoRoundPipe":
        return self.train(False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("roundpipe_run_config", None)
        return self.model(*args, **kwargs)

    __call__ = forward

    def forward_backward(self, *args: Any, **kwargs: Any) -> Any:
        raise RoundPipeUnsupportedError(
            "AutoRoundPipe: %s could not be split into a Sequential, so it has no fused "
            "forward_backward (as upstream); train it with forward() and loss.backward(), wrap "
            "its layers as an nn.Sequential, or pass it to RoundPipe(model) to train it as one "
            "layer" % type(self.model).__name__)

    def _own_parameters(self) -> List[nn.Parameter]:
        """The root's parameters that no inner RoundPipe holds (RoundPipeModule has none)."""
        return list(self.model.parameters())

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        return itertools.chain(
            self._own_parameters(),
            itertools.chain.from_iterable(rp.optim_parameters() for rp in self.roundpipes))

    parameters = optim_parameters

    def optim_named_parameters(self, prefix: str = "") -> Iterator[Any]:
        yield from self.model.named_parameters(prefix=prefix)
        for path, rp in zip(self._paths, self.roundpipes):
            yield from rp.optim_named_parameters(".".join(x for x in (prefix, path) if x))

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[Any]:
        return self.optim_named_parameters(prefix)

    def step(self, step_fn: Any, is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        own = [p for p in self._own_parameters() if p.requires_grad]
        if isinstance(step_fn, BuiltinOptimizer):
            if own:
                raise RoundPipeUnsupportedError(
                    "AutoRoundPipe.step: a built-in optimizer updates the engine's parameters "
                    "only, and %s keeps %d trainable parameter(s) of its own; pass a Python "
                    "step function (a torch optimizer over optim_parameters())"
                    % (type(self.model).__name__, len(own)))
            for rp in self.roundpipes:
                rp.step(step_fn, is_async)
            return
        rps = self.roundpipes
        if not rps:
            step_fn(*args, **kwargs)
            return

        ran = []

        def inside(k: int) -> Any:
            # step_fn runs innermost, once, while every RoundPipe is inside its own step
            if k == len(rps):
                ran.append(True)
                return step_fn(*args, **kwargs)
            return rps[k].step(lambda: inside(k + 1), False)

        asynchronous = is_async and len(rps) == 1 and not own
        rps[0].step(lambda: inside(1), asynchronous)
        if not asynchronous and not ran:
            # A RoundPipe skipped its step (inf / nan gradients, no GradScaler): those inside it
            # never entered theirs, so their gradients and the root's own are dropped as the
            # skipping one's were, and the next step starts clean everywhere.
            for rp in rps:
                rp.zero_grad()
            for p in own:
                p.grad = None

    def synchronize(self) -> None:
        for rp in self.roundpipes:
            rp.synchronize()

    def close(self) -> None:
        for rp in self.roundpipes:
            rp.close()

    def __enter__(self) -> "AutoRoundPipe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def wrap_model_to_roundpipe(model: nn.Module, use_sequential_preset: Optional[bool] = None,
                            lower_threshold: int = 16 * 1024,
                            upper_threshold: Optional[int] = None,
                            skip_modules: Container[nn.Module] = (),
                            override_config: Optional[Dict[nn.Module, RoundPipeRunConfig]] = None,
                            model_run_config: Optional[RoundPipeRunConfig] = None,
                            name: Optional[str] = None, host_memory: str = "standard",
                            native_preset: bool = True, **roundpipe_kwargs: Any
                            ) -> Union[RoundPipe, "AutoRoundPipe"]:
    """Wrap `model` into a RoundPipe (or an AutoRoundPipe), as upstream does.

    1. Presets, unless ``use_sequential_preset=False``: a transformers
       ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``LlamaForCausalLM`` gets the engine's
       native preset (built from
       ``model.config``, weights copied; takes input_ids, attention_mask, position_ids, returns
       logits, trains with ``loss_fn="causal_lm"``, saves with save_pretrained); so does a
       PEFT LoRA model of one (``get_peft_model(model, LoraConfig(...))``), whose adapters the
       engine holds (``RoundPipe(peft_model)``, docs/lora.md: base weights frozen, adapters
       copied in, and written back into the PEFT model by synchronize(), so that PEFT's
       save_pretrained saves the trained ones). A PEFT model the engine's adapters cannot
       express (DoRA, rsLoRA, rank or alpha patterns, some layers only, modules_to_save,
       several adapters, adapters on a Qwen3-MoE model's experts, ...) takes the Python
       Sequential preset below, its base weights frozen and adapters trained in transformers'
       and PEFT's own modules, with a warning naming the reason. Another transformers causal LM
       of a known shape (GPT-2; Llama-like decoders such as Mixtral, also inside a PEFT model)
       becomes an nn.Sequential of its own modules, run as Python layers, that takes input_ids
       (and attention_mask) and returns logits. ``use_sequential_preset=True``
       without a preset raises RoundPipeUnsupportedError (a NotImplementedError).
       ``native_preset=False`` (not upstream's) skips the native presets: a
       ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``LlamaForCausalLM`` (or a PEFT model
       of one) then takes the Python Sequential preset too,
       every layer running transformers' own code (to run transformers' exact modules, or to
       compare the Python-layer path with the native one, as
       bench/python_layers/qwen3_python_layers_bench.py does).
    2. Otherwise upstream's recursion: a module in `skip_modules` stays as it is (on the CPU);
       an nn.Sequential becomes a RoundPipe with its children as layers; a module with its
       own forward whose own parameters are >= `lower_threshold` bytes or whose total size is
       <= `upper_threshold` (default: total size / (devices + 1)) becomes a one-layer
       RoundPipe (num_microbatch 1 below `lower_threshold`); an nn.ModuleList is wrapped
       element by element; anything else is recursed into, its own forward running on the
       calling thread. When the root itself was wrapped the result is that RoundPipe; else an
       :class:`AutoRoundPipe` (forward() with autograd and step(), no fused forward_backward,
       as upstream). `override_config` maps modules to
       their RoundPipeRunConfig.

    The result forwards unknown attributes to `model` (``set_original_model``). `host_memory`
    is RoundPipe's (ValueError for other values, before anything is built); other keyword
    arguments go to :class:`RoundPipe` (e.g. ``devices=("cpu", 2)``, or ``data_parallel=``,
    which needs the whole model to become one RoundPipe: RoundPipeUnsupportedError otherwise).
    """
    parse_host_memory(host_memory)  # fail before converting anything
    data_parallel = parse_data_parallel(roundpipe_kwargs.get("data_parallel"))
    if name is None:
        name = call_site_name()
    if not isinstance(model, nn.Module):
        raise TypeError("wrap_model_to_roundpipe expects an nn.Module, got %s"
                        % type(model).__name__)
    model_run_config = model_run_config or RoundPipeRunConfig()
    override_config = dict(override_config or {})
    kwargs = dict(roundpipe_kwargs, host_memory=host_memory)

    def build(module, config, suffix="", root=True):
        if not root and data_parallel:
            # each inner RoundPipe would join a group of its own, and an AutoRoundPipe only
            # runs forward: data parallelism needs the whole model as one RoundPipe
            raise RoundPipeUnsupportedError(
                "data_parallel needs the whole model wrapped as one RoundPipe (an "
                "nn.Sequential, a preset, or a module small enough to be one layer); %s "
                "would become an AutoRoundPipe of several" % type(model).__name__)
        return RoundPipe(module, name=name + suffix, model_run_config=config, **kwargs)

    if use_sequential_preset is not False:
        base = peft_base_model(model)
        if native_preset and _native(model, base):
            _say_preset(use_sequential_preset, model, "the engine's native")
            wrapped = build(model, model_run_config)
            wrapped.set_original_model(model)
            return wrapped
        # A PEFT model the engine's adapters cannot express: the Python preset of the model it
        # wraps, whose frozen base weights stay frozen and adapters train.
        preset = sequential_preset(base if base is not None else model)
        if preset is not None:
            _say_preset(use_sequential_preset, model, "a Python Sequential")
            wrapped = build(preset, model_run_config)
            wrapped.set_original_model(model)
            wrapped._causal_lm = CausalLM.of_transformers(base if base is not None else model)
            if wrapped._causal_lm is not None:
                wrapped._causal_lm.original = model
            return wrapped
        if use_sequential_preset is True:
            raise RoundPipeUnsupportedError(
                "no Sequential preset exists for %s (native presets: %s; Python presets: "
                "GPT-2 and Llama-like transformers causal LMs, also inside a PEFT model)"
                % (type(model).__name__, ", ".join(HF_ARCHITECTURES)))

    total = _bytes(itertools.chain(model.parameters(), model.buffers()))
    if upper_threshold is None:
        upper_threshold = total / (_device_count(roundpipe_kwargs.get("devices")) + 1)
    skip = list(skip_modules)
    inner: List[RoundPipe] = []
    paths: List[str] = []  # each inner RoundPipe's place in `model`

    def wrap(module, suffix):
        if any(module is s for s in skip):
            return module
        config = override_config.get(module, model_run_config)
        size = _bytes(itertools.chain(module.parameters(), module.buffers()))
        if isinstance(module, nn.Sequential):
            rp = build(module, config, suffix, root=module is model)
        elif _has_own_forward(module) and (
                _bytes(module.parameters(recurse=False)) >= lower_threshold
                or size <= upper_threshold or not len(list(module.children()))):
            # (a module without children cannot be recursed into: it is one layer)
            if size < lower_threshold and module not in override_config:
                config = RoundPipeRunConfig(num_microbatch=1)
            rp = build(module, config, suffix, root=module is model)
        else:
            if isinstance(module, nn.ModuleList) or not _has_own_forward(module) \
                    or len(list(module.children())):
                for child_name, child in list(module.named_children()):
                    wrapped = wrap(child, "%s.%s" % (suffix, child_name))
                    if wrapped is not child:
                        setattr(module, child_name, wrapped)
            return module
        inner.append(rp)
        paths.append(suffix.lstrip("."))
        return rp if module is model else RoundPipeModule(rp)

    result = wrap(model, "")
    if isinstance(result, RoundPipe):
        result.set_original_model(model)
        return result
    return AutoRoundPipe(result, inner, paths)


def _say_preset(use_sequential_preset, model, kind):
    """Upstream prints a message when ``use_sequential_preset=None`` finds a preset (True asked
    for one, so it says nothing then)."""
    if use_sequential_preset is None:
        print("roundpipe: wrap_model_to_roundpipe: %s preset for %s (use_sequential_preset="
              "False skips presets)" % (kind, type(model).__name__), file=sys.stderr)


def _native(model, peft_base):
    """Whether the engine's native preset takes `model`: a Qwen3 / Llama, or a PEFT model
    (around `peft_base`) of one whose adapters the engine can hold; warns when a PEFT model of
    a native architecture cannot take it."""
    if hf_architecture(model) is not None:
        return True
    if peft_base is None or hf_architecture(peft_base) is None:
        return False
    try:
        peft_lora(model, peft_base)
    except RoundPipeUnsupportedError as exc:
        warnings.warn("%s of %s: its adapters run in transformers' and PEFT's modules as "
                      "Python layers, not the engine's native LoRA (%s)"
                      % (type(model).__name__, type(peft_base).__name__, exc.message),
                      stacklevel=3)
        return False
    return True


def _device_count(devices):
    """Worker devices a model built with `devices` would have (upstream: GPUs)."""
    parsed = parse_devices(devices)
    if parsed is not None and parsed[1] > 0:
        return parsed[1]
    from . import cuda_device_count
    return max(1, cuda_device_count())
