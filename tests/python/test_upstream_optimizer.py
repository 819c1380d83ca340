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


def step_both(model, step_fn, ref, ref_opt, it):
    """Iteration `it` on both sides: the model's call (mse / N_MB per microbatch, so its sum is
    plain PyTorch's mean over the batch) and synchronous step_fn; plain PyTorch's backward and
    step."""
    x, y = data(it)
    model.forward_backward((x,), label=y, loss_fn=lambda o, l: mse(o, l) / N_MB)
    model.step(step_fn, is_async=False)
    mse(ref(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()


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
        step_both(model, step_fn, ref, ref_opt, it)
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


def _standalone(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_runs_the_engine_kernel_and_matches_torch_adam(monkeypatch, decoupled):
    """Without a model: two parameter groups (own lr, betas, weight decay), a parameter whose
    gradient is None at one step (its step count lags, as torch's does), an lr scheduler, and
    a state dict that torch.optim.Adam loads and continues from. torch's own step is patched
    to fail, so every update here is rp_adam_apply's."""
    shapes = [(70001,), (7, 13), (1,)]
    ours, ref = _standalone(1, shapes), _standalone(1, shapes)

    def groups(ps):
        return [{"params": ps[:2], "lr": 1e-2, "weight_decay": 0.05},
                {"params": ps[2:], "lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6}]

    opt = Adam(groups(ours), decoupled_weight_decay=decoupled)
    ref_opt = torch.optim.Adam(groups(ref), decoupled_weight_decay=decoupled, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    real_torch_step = torch.optim.Adam.step

    def torch_step_fails(*args, **kwargs):
        pytest.fail("torch.optim.Adam.step ran")

    for it in range(5):
        g = torch.Generator().manual_seed(50 + it)
        for i, (p, q) in enumerate(zip(ours, ref)):
            if it == 1 and i == 1:
                p.grad = q.grad = None  # no gradient this step
                continue
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        monkeypatch.setattr(torch.optim.Adam, "step", torch_step_fails)
        opt.step()
        monkeypatch.setattr(torch.optim.Adam, "step", real_torch_step)
        ref_opt.step()
        sched.step()
        ref_sched.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)
    sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    for k in ref_sd["state"]:
        assert float(sd["state"][k]["step"]) == float(ref_sd["state"][k]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][k][key], ref_sd["state"][k][key],
                                       rtol=RTOL, atol=ATOL)
    assert float(sd["state"][1]["step"]) == 4.0  # skipped once
    # torch.optim.Adam continues from our state dict as from its own
    again = _standalone(1, shapes)
    for p, q in zip(again, ours):
        p.data.copy_(q.detach())
    cont = torch.optim.Adam(groups(again), decoupled_weight_decay=decoupled)
    cont.load_state_dict(copy.deepcopy(sd))  # torch would share our state tensors
    for p, q in zip(again, ref):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    cont.step()
    ref_opt.step()
    for p, q in zip(again, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)
    # and ours continues from torch's: load_state_dict brings new state tensors, which the
    # DLPack views kept between steps must follow
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for p, q in zip(ours, ref):
        p.data.copy_(q.detach())
        p.grad = torch.full_like(p, 0.5)
        q.grad = p.grad.clone()
    monkeypatch.setattr(torch.optim.Adam, "step", torch_step_fails)
    opt.step()
    monkeypatch.setattr(torch.optim.Adam, "step", real_torch_step)
    ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


def test_adam_refused_update_changes_nothing():
    """A gradient that shares memory with a weight being updated is refused by rp_adam_apply
    (RoundPipeError naming the entry) before any tensor or step count of the group changes."""
    ps = _standalone(2, [(5,), (3,)])
    opt = Adam(ps, lr=0.1)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in ps]
    state = copy.deepcopy(opt.state_dict())
    ps[1].grad = ps[0].detach()[:3]  # contiguous, the right shape, inside param 0
    with pytest.raises(roundpipe.RoundPipeError, match="grad 1 overlaps param 0"):
        opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p.detach(), b)
    after = opt.state_dict()
    for k in state["state"]:
        for key, v in state["state"][k].items():
            assert torch.equal(after["state"][k][key], v)


class Gated(torch.nn.Module):
    """`extra` is used only while `use_extra` is set: a parameter some steps do not reach, as
    an expert of a mixture no token was routed to."""

    def __init__(self):
        super().__init__()
        self.main = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.use_extra = False

    def forward(self, x):
        y = torch.tanh(self.main(x))
        return y + self.extra(y) if self.use_extra else y


def gated_net():
    torch.manual_seed(4)
    return torch.nn.Sequential(Gated(), torch.nn.Linear(8, 4))


def test_a_parameter_no_call_reached_has_no_grad_and_torch_optim_leaves_it_alone():
    """torch autograd leaves .grad None on a parameter the backward did not reach, and
    torch.optim.AdamW then skips it (no weight decay, no update from its moments): the step
    function sees the same, so training matches plain PyTorch step for step."""
    ref = gated_net()
    module = copy.deepcopy(ref)
    model = roundpipe.RoundPipe(module, devices=("cpu", 2))
    opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    seen = []

    def step_fn():
        seen.append([n for n, p in model.optim_named_parameters() if p.grad is None])
        opt.step()
        opt.zero_grad()

    for it, use_extra in enumerate([True, False, False, True]):
        module[0].use_extra = ref[0].use_extra = use_extra
        step_both(model, step_fn, ref, ref_opt, it)
        for (name, p), q in zip(model.optim_named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name, it=it: "%s, step %d: %s"
                                       % (name, it, m))
    unreached = ["0.extra.weight", "0.extra.bias"]
    assert seen == [[], unreached, unreached, []]
    assert len(opt.state) == len(ref_opt.state) == 6
    model.close()


def test_synchronize_gives_no_grad_to_a_parameter_no_call_reached():
    """After synchronize() the module's .grad is None where no call reached the parameter,
    as autograd leaves it, and the views synchronize() hands out do not make the next built-in
    step update it (hand-checked: unchanged, bit for bit)."""
    module = gated_net()
    model = roundpipe.RoundPipe(module, devices=("cpu", 2))
    x, y = data(0)
    model.forward_backward((x,), label=y, loss_fn=mse)  # use_extra unset: `extra` not reached
    model.synchronize()
    assert module[0].extra.weight.grad is None and module[0].extra.bias.grad is None
    assert module[0].main.weight.grad is not None
    before = {n: p.detach().clone() for n, p in model.optim_named_parameters()}
    model.step(roundpipe.optim.AdamW(lr=1e-2, weight_decay=0.1), is_async=False)
    after = dict(model.optim_named_parameters())
    for name in ("0.extra.weight", "0.extra.bias"):
        assert torch.equal(after[name].detach(), before[name]), name
    assert not torch.equal(after["0.main.weight"].detach(), before["0.main.weight"])
    model.close()
