"""Every name that bindings/python/README.md's compatibility table marks supported (or
differs) exists with upstream's spelling, so the table stays true; and the package ships
py.typed (PEP 561)."""

import importlib
import inspect
import os

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402

SUPPORTED = [
    "roundpipe.RoundPipe",
    "roundpipe.RoundPipe.forward",
    "roundpipe.RoundPipe.forward_backward",
    "roundpipe.RoundPipe.optim_parameters",
    "roundpipe.RoundPipe.optim_named_parameters",
    "roundpipe.RoundPipe.step",
    "roundpipe.RoundPipe.synchronize",
    "roundpipe.RoundPipe.set_original_model",
    "roundpipe.RoundPipe.parameters",
    "roundpipe.RoundPipe.named_parameters",
    "roundpipe.wrap_model_to_roundpipe",
    "roundpipe.AutoRoundPipe",
    "roundpipe.RoundPipeRunConfig",
    "roundpipe.ModelExecutePlan",
    "roundpipe.ModelExecutePlan.auto",
    "roundpipe.save_for_recompute",
    "roundpipe.doing_recompute",
    "roundpipe.get_recompute_data",
    "roundpipe.OptimizerCtx",
    "roundpipe.GradScaler",
    "roundpipe.GradScaler.scale",
    "roundpipe.GradScaler.unscale_",
    "roundpipe.GradScaler.step",
    "roundpipe.GradScaler.update",
    "roundpipe.GradScaler.get_scale",
    "roundpipe.GradScaler.get_growth_factor",
    "roundpipe.GradScaler.set_growth_factor",
    "roundpipe.GradScaler.get_backoff_factor",
    "roundpipe.GradScaler.set_backoff_factor",
    "roundpipe.GradScaler.get_growth_interval",
    "roundpipe.GradScaler.set_growth_interval",
    "roundpipe.GradScaler.state_dict",
    "roundpipe.GradScaler.load_state_dict",
    "roundpipe.optim.Adam",
    "roundpipe.ModelTimer",
    "roundpipe.timer.ModelTimer.VERBOSE",
]


def resolve(dotted):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name", SUPPORTED)
def test_supported_name_exists(name):
    resolve(name)


def test_from_imports_of_the_upstream_pages():
    from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig  # noqa: F401
    from roundpipe import ModelExecutePlan  # noqa: F401
    from roundpipe import doing_recompute, get_recompute_data, save_for_recompute  # noqa: F401
    from roundpipe.optim import Adam  # noqa: F401
    from roundpipe.timer import ModelTimer  # noqa: F401


def test_documented_signatures():
    params = inspect.signature(roundpipe.GradScaler).parameters
    assert {k: v.default for k, v in params.items()} == {
        "init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 2000, "enabled": True}
    update = inspect.signature(roundpipe.GradScaler.update).parameters
    assert update["new_scale"].default is None and update["is_async"].default is True
    adam = inspect.signature(roundpipe.optim.Adam).parameters
    assert list(adam)[:6] == ["params", "lr", "betas", "eps", "weight_decay", "amsgrad"]
    for kw in ("foreach", "maximize", "capturable", "differentiable", "fused",
               "decoupled_weight_decay"):
        assert adam[kw].kind is inspect.Parameter.KEYWORD_ONLY
    assert adam["weight_decay"].default == 0.0 and adam["lr"].default == 1e-3
    step = inspect.signature(roundpipe.RoundPipe.step).parameters
    assert list(step)[:3] == ["self", "step_fn", "is_async"] and step["is_async"].default is True


def test_py_typed_is_shipped():
    package = os.path.dirname(roundpipe.__file__)
    assert os.path.isfile(os.path.join(package, "py.typed"))
