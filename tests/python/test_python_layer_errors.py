"""Bad Python layers fail the call with an error naming the layer and what was wrong; the model
stays usable and the gradients accumulated by earlier calls are intact (issue 13).

Each test accumulates the gradients of one good call, makes a bad one, then checks: the error
names the layer; the accumulated gradients equal plain PyTorch's for the good call alone
(fp32, relative 1e-5, absolute floor 1e-6, as test_python_layers.py); and a further good
call still works. Wrong gradients cannot come out of torch autograd, so those tests replace the
layer's ``param_grads`` hook (the last step before the gradients are handed to the engine).
"""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeError  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6
DEVICES = ("cpu", 2)
N_MB = 3


class Switchable(nn.Module):
    """A linear block whose forward misbehaves as `self.mode` says."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.mode = None

    def forward(self, x):
        out = torch.tanh(self.lin(x))
        if self.mode == "raise":
            raise ValueError("boom from the module")
        if self.mode == "recompute_shape" and roundpipe.doing_recompute():
            return out[:, :-1]
        if self.mode == "recompute_count" and roundpipe.doing_recompute():
            return out, out
        if self.mode == "recompute_dtype" and roundpipe.doing_recompute():
            return out.to(torch.int64)
        if self.mode == "no_tensor":
            return None
        if self.mode == "pair":
            return out, out
        return out


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), Switchable(), Switchable(), nn.Linear(8, 2))
    net[2].lin.weight.requires_grad_(False)
    return net


def mse(out, y):
    return F.mse_loss(out, y)


@pytest.fixture
def setup():
    net = build()
    ref = copy.deepcopy(net)
    model = roundpipe.RoundPipe(net, devices=DEVICES)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    model.forward_backward((x,), label=y, loss_fn=mse)  # the good call whose grads must stay
    for xm, ym in zip(torch.tensor_split(x, N_MB), torch.tensor_split(y, N_MB)):
        mse(ref(xm), ym).backward()
    yield model, net, ref, (x, y)
    model.close()


def assert_intact(model, net, ref, batch):
    model.synchronize()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))
    net[1].mode = net[2].mode = None
    for layer in model._python_layers:
        layer.__dict__.pop("param_grads", None)
    x, y = batch
    assert torch.isfinite(model.forward_backward((x,), label=y, loss_fn=mse))


@pytest.mark.parametrize("mode", ["raise", "no_tensor"])
def test_module_that_fails_names_the_layer(setup, mode):
    model, net, ref, batch = setup
    net[2].mode = mode
    with pytest.raises(RoundPipeError) as info:
        model.forward_backward(batch, label=batch[1], loss_fn=mse)
    message = str(info.value)
    assert "layer 2" in message and "Switchable" in message
    assert ("boom from the module" in message) if mode == "raise" else ("no tensor" in message)
    if mode == "raise":
        assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RoundPipeError):
        model(batch[0])  # forward() reports it too
    assert_intact(model, net, ref, batch)


def test_a_tuple_spread_over_a_module_that_takes_one_argument_is_explained(setup):
    # nn.Sequential would pass the pair as one argument; RoundPipe spreads it (upstream's rule),
    # so layer 2's forward(x) gets two: the message says why.
    model, net, ref, batch = setup
    net[1].mode = "pair"
    with pytest.raises(RoundPipeError) as info:
        model.forward_backward(batch, label=batch[1], loss_fn=mse)
    message = str(info.value)
    assert "layer 2" in message and "positional argument" in message
    assert "layer 1 returned a tuple of 2, which RoundPipe passes to layer 2 as 2 positional " \
        "arguments" in message
    assert isinstance(info.value.__cause__, TypeError)
    assert_intact(model, net, ref, batch)


@pytest.mark.parametrize("mode", ["recompute_shape", "recompute_count", "recompute_dtype"])
def test_outputs_that_change_in_the_recompute_fail_the_call(setup, mode):
    model, net, ref, batch = setup
    net[1].mode = mode
    with pytest.raises(RoundPipeError) as info:
        model.forward_backward((batch[0],), label=batch[1], loss_fn=mse)
    assert "layer 1" in str(info.value) and "recompute" in str(info.value)
    assert_intact(model, net, ref, batch)


def _bad_grads(kind):
    def param_grads(ctx, grads):
        grads = list(grads)
        if kind == "shape":
            grads[0] = torch.zeros(3, 3)
        elif kind == "dtype":
            grads[0] = torch.zeros_like(grads[0], dtype=torch.int64)
        elif kind == "count":
            grads = grads[:-1]
        elif kind == "frozen":
            grads[0] = torch.zeros(8, 8)  # lin.weight of layer 2 is frozen
        return grads
    return param_grads


@pytest.mark.parametrize("kind", ["shape", "dtype", "count", "frozen"])
def test_bad_parameter_gradients_fail_the_call(setup, kind):
    model, net, ref, batch = setup
    # layer 1: every parameter trainable; layer 2: lin.weight frozen
    layer = {l.index: l for l in model._python_layers}[2 if kind == "frozen" else 1]
    layer.param_grads = _bad_grads(kind)
    with pytest.raises(RoundPipeError) as info:
        model.forward_backward((batch[0],), label=batch[1], loss_fn=mse)
    message = str(info.value)
    assert ("layer %d (python:Switchable)" % layer.index) in message, message
    assert_intact(model, net, ref, batch)
