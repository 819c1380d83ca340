"""Upstream's optimizer pages (API_optimizer, UserGuide_BasicUsage_optimizer): roundpipe.optim.Adam
inside step_fn against torch.optim.Adam, OptimizerCtx, and the documented compatibility
placeholders. fp32: relative 1e-5, absolute floor 1e-6."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import OptimizerCtx, RoundPipeUnsupportedError  # noqa: E402
from roundpipe.context import in_optimizer_ctx  # noqa: E402
from roundpipe.optim import Adam  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
N_MB = 3


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data(it):
    g = torch.Generator().manual_seed(200 + it)
    return torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g)


def mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("kwargs", [
    {},
    {"weight_decay": 0.01},
    {"weight_decay": 0.01, "decoupled_weight_decay": True},
    {"amsgrad": True, "betas": (0.8, 0.99), "eps": 1e-6},
    {"maximize": True, "lr": 1e-3},
])
def test_adam_in_step_fn_matches_torch_adam(kwargs):
    ref = net()
    model = roundpipe.RoundPipe(copy.deepcopy(ref), devices=("cpu", 2))
    kwargs = dict({"lr": 1e-2}, **kwargs)
    with OptimizerCtx():
        optimizer = Adam(model.parameters(), **kwargs)
    ref_opt = torch.optim.Adam(ref.parameters(), **kwargs)

    def step_fn():
        optimizer.step()
        optimizer.zero_grad()

    for it in range(5):
        x, y = data(it)
        model.forward_backward((x,), label=y, loss_fn=lambda o, l: mse(o, l) / N_MB)
        model.step(step_fn, is_async=False)
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.optim_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)
    state = optimizer.state_dict()
    assert set(state["state"][0]) == set(ref_opt.state_dict()["state"][0])
    model.close()


def test_optimizer_ctx_redirects_parameters_and_param_groups():
    model = roundpipe.RoundPipe(net(), devices=("cpu", 1))
    optim_params = list(model.optim_parameters())
    with OptimizerCtx():
        assert in_optimizer_ctx()
        assert all(a is b for a, b in zip(model.parameters(), optim_params))
        assert [n for n, _ in model.named_parameters()] == \
            [n for n, _ in model.optim_named_parameters()]
        optimizer = torch.optim.AdamW([{"params": model.parameters(), "lr": 1e-4}])
    assert not in_optimizer_ctx()
    assert optimizer.param_groups[0]["lr"] == 1e-4
    assert all(p.dtype == torch.float32 for p in optimizer.param_groups[0]["params"])
    seen = []
    model.forward_backward((data(0)[0],), label=data(0)[1], loss_fn=mse)
    model.step(lambda: seen.append(in_optimizer_ctx()), is_async=False)
    assert seen == [True]
    model.close()


def test_step_fn_gets_args_and_torch_optimizers_work():
    """Any torch optimizer (fused where it exists) works in step_fn; step forwards *args and
    **kwargs to step_fn."""
    ref = net(3)
    model = roundpipe.RoundPipe(copy.deepcopy(ref), devices=("cpu", 2))
    opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    calls = []

    def step_fn(tag, scale=1.0):
        calls.append((tag, scale))
        opt.step()
        opt.zero_grad()

    for it in range(3):
        x, y = data(it)
        model.forward_backward((x,), label=y, loss_fn=lambda o, l: mse(o, l) / N_MB)
        model.step(step_fn, False, it, scale=2.0)
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert calls == [(0, 2.0), (1, 2.0), (2, 2.0)]
    model.synchronize()
    for p, q in zip(model.optim_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)
    model.close()


def test_compatibility_placeholders_and_limits():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.warns(UserWarning, match="foreach"):
        Adam([p], foreach=True)
    with pytest.warns(UserWarning, match="fused"):
        Adam([p], fused=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Adam([p])  # no warning by default
    with pytest.raises(RoundPipeUnsupportedError):
        Adam([p], capturable=True)
    with pytest.raises(RoundPipeUnsupportedError):
        Adam([p], differentiable=True)
    with pytest.raises(ValueError, match="float32"):
        Adam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    with pytest.raises(ValueError, match="contiguous"):
        Adam([torch.nn.Parameter(torch.zeros(3, 4).t())])
    opt = Adam([p])
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    # a tensor learning rate, as torch.optim.Adam accepts
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.ones(2)
    Adam([q], lr=torch.tensor(0.1)).step()
    assert torch.allclose(q.detach(), torch.full((2,), 0.9))
