"""Runtime options and records the binding exposes: loss scaling, the GPU memory cap, the trace.

Loss scaling by a power of two is exact in fp32, so a scaled run must equal an unscaled one
bit for bit; the trace must hold one compute event per (job, microbatch) of the last call.
"""

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from rp_reference import MLP_SPEC  # noqa: E402


def batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g)


def train(model, steps=3):
    x, y = batch()
    losses = []
    for _ in range(steps):
        losses.append(float(model.forward_backward((x,), label=y, loss_fn="mse")))
        model.step(roundpipe.optim.AdamW(lr=1e-2), is_async=False)
    model.synchronize()
    return losses


def test_scaled_fp32_training_equals_unscaled_training_exactly():
    with roundpipe.RoundPipe(MLP_SPEC, devices=("cpu", 2), seed=1, grad_scaler=False) as plain, \
            roundpipe.RoundPipe(MLP_SPEC, devices=("cpu", 2), seed=1,
                                grad_scaler=(4096.0, 100)) as scaled:
        assert plain.grad_scale == (0.0, 0)
        assert train(plain) == train(scaled)
        for (name, a), (_, b) in zip(plain.state_dict().items(), scaled.state_dict().items()):
            assert torch.equal(a, b), name
        assert scaled.grad_scale == (4096.0, 0)


def test_float16_models_scale_losses_by_default():
    with roundpipe.RoundPipe(MLP_SPEC, devices=("cpu", 1), model_dtype=torch.float16) as m:
        assert m.grad_scale == (65536.0, 0)


def test_trace_has_one_compute_event_per_job_and_microbatch():
    with roundpipe.RoundPipe(MLP_SPEC, devices=("cpu", 2), seed=1) as model:
        x, y = batch()
        model.forward_backward((x,), label=y, loss_fn="mse")
        events = [e for e in model.trace()["traceEvents"]
                  if e.get("pid") != 1000 and e["ph"] == "X"]  # device spans, not process names
        jobs = 2 * model.num_stages - 1  # forward stages, the fused tail, backward stages
        compute = [e for e in events if e["tid"] == "compute"]
        # A backward's recompute runs before its gradient arrives, in a span of its own.
        ahead = [e for e in compute if e["args"].get("content") == "recompute ahead"]
        assert len(compute) - len(ahead) == jobs * 3
        assert len(ahead) == (model.num_stages - 1) * 3
        assert {e["args"]["kind"] for e in ahead} == {"backward"}
        assert {e["args"]["kind"] for e in events} == {"forward", "tail", "backward"}
        assert model.gpu_memory_cap == 0  # CPU devices have no cap
        host = [e for e in model.trace()["traceEvents"] if e.get("pid") == 1000 and e["ph"] == "X"]
        assert {e["name"] for e in host if e["tid"] == "caller"} >= {"prepare", "pipeline"}


def test_bad_scaler_settings_raise_with_the_engine_message():
    with pytest.raises(roundpipe.RoundPipeError, match="growth_interval"):
        roundpipe.RoundPipe(MLP_SPEC, devices=("cpu", 1), grad_scaler=(2.0, 0))


def test_engine_scaler_and_skip_rule_switch_on_a_live_model():
    """RoundPipe.set_grad_scaler / set_skip_nonfinite_steps (rp_model_set_grad_scaler,
    rp_model_set_skip_nonfinite_steps): the scale reads back, an overflow with skipping off
    reaches the weights, and bad values raise RoundPipeError naming the argument."""
    import torch
    import roundpipe
    torch.manual_seed(0)
    model = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 2)), devices=("cpu", 1))
    assert model.grad_scale[0] == 0.0
    model.set_grad_scaler(512.0, 10)
    assert model.grad_scale == (512.0, 0)
    with pytest.raises(roundpipe.RoundPipeError, match="growth_interval"):
        model.set_grad_scaler(2.0, 0)
    with pytest.raises(roundpipe.RoundPipeError, match="scale"):
        model.set_grad_scaler(-1.0)
    assert model.grad_scale == (512.0, 0)
    model.set_grad_scaler(0.0)
    model.set_skip_nonfinite_steps(False)
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model.forward_backward((x,), label=torch.zeros(3, 2), loss_fn="mse")
    model.step(roundpipe.optim.SGD(lr=0.1), is_async=False)
    model.synchronize()
    assert not torch.isfinite(next(model.optim_parameters())).all()
    model.close()
