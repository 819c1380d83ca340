"""Autograd through forward() (upstream's non-fused training): in training mode with gradients
enabled, ``loss.backward()`` on forward()'s outputs back-propagates through the pipeline
(rp_forward_train + rp_backward) and accumulates the gradients the next step uses.

References are plain torch on the same weights and data. Tolerance: fp32, relative 1e-5 plus an
absolute 1e-6 floor; both sides run the same fp32 kernels, and what differs is summation order
(microbatches and stages against one pass), a few ulp per operation.
"""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe.errors import RoundPipeError, Status  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
DEVICES = ("cpu", 2)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


class Scaled(nn.Module):
    """A module the engine does not know: it runs as a Python layer (BatchNorm buffers too)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return self.norm(x) * self.gain


def test_backward_through_forward_matches_torch_and_the_next_step_uses_it():
    module = mlp()
    reference = mlp()  # same seed, same weights
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with roundpipe.RoundPipe(module, devices=DEVICES) as model:
        sgd = roundpipe.optim.SGD(lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(9, 6, generator=g), torch.randn(9, 3, generator=g)
            out = model(x)
            assert out.requires_grad
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            ref_loss = nn.functional.mse_loss(reference(x), y)
            ref_loss.backward()
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL)
            model.synchronize()
            for p, r in zip(module.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, r.grad, **TOL)
            model.step(sgd, is_async=False)
            model.zero_grad()
            opt.step()
            opt.zero_grad()


def test_python_layers_back_propagate_through_forward():
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(6, 16), Scaled(), nn.ReLU(), nn.Linear(16, 2))
    reference = nn.Sequential(*[m for m in module])  # the same modules: read before training
    ref_state = {k: v.clone() for k, v in module.state_dict().items()}
    x = torch.randn(12, 6)
    with roundpipe.RoundPipe(module, devices=DEVICES) as model:
        out = model(x)
        out.pow(2).mean().backward()
        model.synchronize()
        got = {n: p.grad.clone() for n, p in module.named_parameters()}
    # Plain torch over the same three microbatches (BatchNorm normalises per microbatch).
    reference.load_state_dict(ref_state)
    reference.zero_grad()
    total = sum(reference(xm).pow(2).sum() for xm in torch.tensor_split(x, 3)) / out.numel()
    total.backward()
    for n, p in reference.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL)


def test_one_backward_per_forward_and_none_after_a_step():
    with roundpipe.RoundPipe(mlp(), devices=DEVICES) as model:
        x = torch.randn(6, 6)
        out = model(x)
        out.sum().backward()
        with pytest.raises(RuntimeError, match="once"):  # the forward's engine state is consumed
            out.sum().backward()
        out = model(x)
        model.step(roundpipe.optim.SGD(lr=0.1), is_async=False)
        with pytest.raises(RoundPipeError) as err:
            out.sum().backward()
        assert err.value.status == Status.STATE


def test_no_grad_and_eval_forward_are_inference():
    with roundpipe.RoundPipe(mlp(), devices=DEVICES) as model:
        x = torch.randn(6, 6)
        with torch.no_grad():
            assert not model(x).requires_grad
        model.eval()
        assert not model(x).requires_grad


def test_run_config_requires_grad_overrides_torchs_mode():
    """RoundPipeRunConfig(requires_grad=...), upstream's switch: True trains a forward under
    torch.no_grad() (the gradients equal torch's), False makes a forward with gradients enabled
    inference (nothing accumulates); model-level and per call."""
    module, reference = mlp(), mlp()
    x, y = torch.randn(9, 6), torch.randn(9, 3)
    on = roundpipe.RoundPipeRunConfig(requires_grad=True)
    off = roundpipe.RoundPipeRunConfig(requires_grad=False)
    with roundpipe.RoundPipe(module, devices=DEVICES) as model:
        out = model(x, roundpipe_run_config=off)
        assert not out.requires_grad
        with torch.no_grad():
            out = model(x, roundpipe_run_config=on)
        assert out.requires_grad
        nn.functional.mse_loss(out, y).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        model.synchronize()
        for p, r in zip(module.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, r.grad, **TOL)
    with roundpipe.RoundPipe(mlp(), devices=DEVICES, model_run_config=off) as model:
        assert not model(x).requires_grad
        assert model(x, roundpipe_run_config=on).requires_grad


def test_input_gradient_matches_torch():
    """x.grad through forward() (rp_backward_input_grads), over microbatches and two stages,
    equals plain torch's; an integer input alongside is left alone."""
    module, reference = mlp(), mlp()
    with roundpipe.RoundPipe(module, devices=DEVICES) as model:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(9, 6, generator=g, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        w = torch.randn(9, 3, generator=g)
        (model(x) * w).sum().backward()
        (reference(x_ref) * w).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
        model.synchronize()
        for p, r in zip(module.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, r.grad, **TOL)


def test_two_models_chain_through_gradients():
    """B(A(x)): the loss's backward runs B's pipeline backward, hands A's outputs their
    gradient, runs A's, and reaches x, as for the two halves as one torch model."""
    torch.manual_seed(3)
    first = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
    second = nn.Sequential(nn.GELU(), nn.Linear(8, 3))
    ref_first = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
    ref_second = nn.Sequential(nn.GELU(), nn.Linear(8, 3))
    ref_first.load_state_dict(first.state_dict())
    ref_second.load_state_dict(second.state_dict())
    with roundpipe.RoundPipe(first, devices=DEVICES) as a, \
            roundpipe.RoundPipe(second, devices=("cpu", 1)) as b:
        g = torch.Generator().manual_seed(8)
        x = torch.randn(10, 6, generator=g, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        y = torch.randn(10, 3, generator=g)
        nn.functional.mse_loss(b(a(x)), y).backward()
        nn.functional.mse_loss(ref_second(ref_first(x_ref)), y).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
        a.synchronize()
        b.synchronize()
        for mine, ref in ((first, ref_first), (second, ref_second)):
            for p, r in zip(mine.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, r.grad, **TOL)
