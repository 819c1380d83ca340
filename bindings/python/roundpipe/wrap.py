"""wrap_model_to_roundpipe: upstream's automatic entry point, for the models the engine has."""

from torch import nn

from .config import RoundPipeRunConfig
from .convert import SUPPORTED_INPUTS, convert_module
from .errors import RoundPipeUnsupportedError
from .hf import HF_ARCHITECTURES, hf_architecture
from ._args import call_site_name, parse_host_memory
from .model import RoundPipe


def wrap_model_to_roundpipe(model, use_sequential_preset=None, lower_threshold=16 * 1024,
                            upper_threshold=None, skip_modules=(), override_config=None,
                            model_run_config=None, name=None, host_memory="standard",
                            **roundpipe_kwargs):
    """Wrap `model` into a RoundPipe.

    Supported:
    - Hugging Face ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` (transformers objects, or
      subclasses): the engine's preset for them, built from ``model.config`` with the model's
      weights copied (by Hugging Face tensor name) and the model's dtype. The result takes
      ``input_ids``, ``attention_mask`` and ``position_ids``, returns logits, trains with
      ``loss_fn="causal_lm"``, saves with ``save_pretrained(dir)`` and forwards unknown
      attributes (``config``, ``vocab_size``, ...) to `model` (see ``set_original_model``).
    - an ``nn.Sequential`` (or a single module) of the modules listed in
      ``roundpipe.convert.SUPPORTED_MODULES``; each child becomes one pipeline layer and the
      weights are copied.

    Upstream's recursive wrapping of arbitrary modules (``skip_modules``, ``override_config``,
    the thresholds) has no engine counterpart: `lower_threshold` and `upper_threshold` are
    accepted and ignored, non-empty `skip_modules` / `override_config` are refused, and so is
    ``use_sequential_preset=False`` for a Hugging Face model.

    `host_memory` is :class:`RoundPipe`'s: ``"standard"`` (default) or ``"saving"`` (12 bytes
    of host state per parameter; see RoundPipe); any other value raises ValueError before
    anything is built. Extra keyword arguments go to :class:`RoundPipe` (e.g.
    ``devices=("cpu", 2)``).
    """
    parse_host_memory(host_memory)  # fail before converting anything
    if name is None:
        name = call_site_name()
    if skip_modules or override_config:
        raise RoundPipeUnsupportedError("skip_modules and override_config need upstream's "
                                        "recursive wrapping, which the C engine does not do. "
                                        "Supported: %s." % SUPPORTED_INPUTS)
    if not isinstance(model, nn.Module):
        raise TypeError("wrap_model_to_roundpipe expects an nn.Module, got %s"
                        % type(model).__name__)
    arch = hf_architecture(model)
    if arch is not None:
        if use_sequential_preset is False:
            raise RoundPipeUnsupportedError(
                "%s with use_sequential_preset=False needs recursive wrapping, which the C "
                "engine does not do; leave use_sequential_preset at None or True to use the "
                "engine's %s preset" % (type(model).__name__, arch))
    else:
        if use_sequential_preset is True:
            raise RoundPipeUnsupportedError("no Sequential preset exists for %s (presets: %s)"
                                            % (type(model).__name__, ", ".join(HF_ARCHITECTURES)))
        convert_module(model)  # raises, listing what is supported, before anything is built
    wrapped = RoundPipe(model, name=name,
                        model_run_config=model_run_config or RoundPipeRunConfig(),
                        host_memory=host_memory, **roundpipe_kwargs)
    wrapped.set_original_model(model)
    return wrapped
