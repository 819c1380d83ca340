"""wrap_model_to_roundpipe: upstream's automatic entry point, for the models the engine has."""

from torch import nn

from .config import RoundPipeRunConfig
from .convert import HF_ARCHITECTURES, SUPPORTED_INPUTS, _unsupported_hf, convert_module
from .errors import RoundPipeUnsupportedError
from .model import RoundPipe, _call_site_name


def wrap_model_to_roundpipe(model, use_sequential_preset=None, lower_threshold=16 * 1024,
                            upper_threshold=None, skip_modules=(), override_config=None,
                            model_run_config=None, name=None, **roundpipe_kwargs):
    """Wrap `model` into a RoundPipe.

    Supported now: an ``nn.Sequential`` (or a single module) of the modules listed in
    ``roundpipe.convert.SUPPORTED_MODULES``; each child becomes one pipeline layer and the
    weights are copied. Hugging Face ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` are recognised
    but refused (RoundPipeUnsupportedError) until the engine has transformer layers. Upstream's
    recursive wrapping of arbitrary modules (``skip_modules``, ``override_config``, the
    thresholds) has no engine counterpart: `lower_threshold` and `upper_threshold` are accepted
    and ignored, non-empty `skip_modules` / `override_config` are refused.

    Extra keyword arguments go to :class:`RoundPipe` (e.g. ``devices=("cpu", 2)``).
    """
    if name is None:
        name = _call_site_name()
    arch = type(model).__name__
    if arch in HF_ARCHITECTURES:
        if use_sequential_preset is False:
            raise RoundPipeUnsupportedError(
                "%s with use_sequential_preset=False needs recursive wrapping, which the C "
                "engine does not do. Supported: %s." % (arch, SUPPORTED_INPUTS))
        raise _unsupported_hf(arch)
    if use_sequential_preset is True:
        raise RoundPipeUnsupportedError("no Sequential preset exists for %s (presets: %s, not "
                                        "available yet)" % (arch, ", ".join(HF_ARCHITECTURES)))
    if skip_modules or override_config:
        raise RoundPipeUnsupportedError("skip_modules and override_config need upstream's "
                                        "recursive wrapping, which the C engine does not do")
    if not isinstance(model, nn.Module):
        raise TypeError("wrap_model_to_roundpipe expects an nn.Module, got %s" % arch)
    convert_module(model)  # raises, listing what is supported, before anything is built
    return RoundPipe(model, name=name,
                     model_run_config=model_run_config or RoundPipeRunConfig(),
                     **roundpipe_kwargs)
