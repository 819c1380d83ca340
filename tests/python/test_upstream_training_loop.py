"""Upstream's training-loop page (UserGuide_BasicUsage_training_loop) against plain PyTorch:
forward_backward's parameters and return values, step(step_fn) asynchronous with staleness one
and synchronous, synchronize() publishing weights and gradients, evaluation with forward().
fp32: relative 1e-5, absolute floor 1e-6."""

import copy

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import GradScaler, OptimizerCtx, RoundPipeRunConfig  # noqa: E402
from roundpipe.optim import Adam  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
N_MB = 3


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data(it):
    g = torch.Generator().manual_seed(300 + it)
    return torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g)


def criterion(out, y):
    return torch.nn.functional.mse_loss(out, y)


def close(a, b):
    torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)


def test_forward_backward_returns_loss_sum_and_outputs():
    ref = net()
    model = roundpipe.RoundPipe(copy.deepcopy(ref), devices=("cpu", 2))
    x, y = data(0)
    loss, outputs = model.forward_backward(
        input_args=(x,), input_kwargs={}, label=y,
        loss_fn=lambda outputs, labels: criterion(outputs, labels) / N_MB,
        return_outputs=True, run_config=RoundPipeRunConfig())
    ref_out = ref(x)
    close(outputs, ref_out)
    # the sum of per-microbatch losses, each / num_microbatch: the batch mean here
    expected = sum(criterion(o, l) for o, l in zip(ref_out.chunk(N_MB), y.chunk(N_MB))) / N_MB
    assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-6)
    only_loss = model.forward_backward(input_args=(x,), label=y, loss_fn=criterion)
    assert isinstance(only_loss, torch.Tensor) and only_loss.dim() == 0
    model.close()


def test_synchronize_publishes_accumulated_gradients():
    ref = net(1)
    model = roundpipe.RoundPipe(copy.deepcopy(ref), devices=("cpu", 2))
    x, y = data(1)
    model.forward_backward((x,), label=y, loss_fn=lambda o, l: criterion(o, l) / N_MB)
    model.synchronize()
    criterion(ref(x), y).backward()
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        close(p.grad, q.grad)
    model.close()


@pytest.mark.parametrize("is_async", [True, False])
def test_training_loop_against_torch(is_async):
    """The page's loop with Adam in step_fn. Async: each forward_backward runs on the weights
    from before the previous step (staleness one); sync: plain torch exactly."""
    ref = net(2)
    model = roundpipe.RoundPipe(copy.deepcopy(ref), devices=("cpu", 2))
    with OptimizerCtx():
        optimizer = Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    stale = copy.deepcopy(ref)  # the weights the engine computes with in async mode

    def step_fn():
        optimizer.step()
        optimizer.zero_grad()

    for it in range(6):
        x, y = data(it)
        loss = model.forward_backward(input_args=(x,), label=y,
                                      loss_fn=lambda o, l: criterion(o, l) / N_MB)
        model.step(step_fn, is_async=is_async)
        used = stale if is_async else ref
        previous = copy.deepcopy(ref)
        # gradients at the weights used, applied to the latest weights
        grads = torch.autograd.grad(criterion(used(x), y), list(used.parameters()))
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        assert float(loss) == pytest.approx(float(criterion(used(x), y)), rel=1e-5)
        ref_opt.step()
        ref_opt.zero_grad()
        stale = previous
    model.synchronize()
    for p, q in zip(model.optim_parameters(), ref.parameters()):
        close(p, q)
    for p, q in zip(model.model.parameters(), ref.parameters()):
        close(p, q)
    model.close()


def test_evaluation_with_forward_and_grad_scaler_loop():
    """The page's GradScaler loop, then evaluation: synchronize(), eval(), no_grad, model(x)."""
    ref = net(4)
    model = roundpipe.RoundPipe(copy.deepcopy(ref), devices=("cpu", 2))
    with OptimizerCtx():
        optimizer = Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)

    def step_fn():
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], max_norm=1.0)
        scaler.step(optimizer)
        optimizer.zero_grad()

    for it in range(3):
        x, y = data(it)
        model.forward_backward(input_args=(x,), label=y,
                               loss_fn=lambda o, l: scaler.scale(criterion(o, l)) / N_MB)
        model.step(step_fn, is_async=False)
        scaler.update(is_async=False)
        criterion(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    model.synchronize()
    model.eval()
    x, _ = data(9)
    with torch.no_grad():
        out = model(x)
        out2 = model.forward(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2))
    close(out, ref(x))
    close(out2, ref(x))
    model.train()
    model.close()
