"""Upstream's page "Multi-GPU Training" (UserGuide_BasicUsage_multi_gpu), with CPU worker devices
standing in for GPUs: the same script runs on 1, 2 and 3 devices without changes; with
num_microbatch fixed, losses, gradients and updated weights do not depend on the device count;
the default num_microbatch is devices + 1; against plain PyTorch."""

import copy

import pytest

torch = pytest.importorskip("torch")

from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def my_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def my_loss_fn(out, label):
    return ((out - label) ** 2).sum()


def data(steps=3):
    torch.manual_seed(42)
    return [(torch.randn(9, 8), torch.randn(9, 4)) for _ in range(steps)]


def train(num_devices, num_microbatch=9, steps=3):
    """The page's loop, unchanged but for the device count."""
    net = my_model()
    model = RoundPipe(net, optim_dtype=torch.float32, devices=("cpu", num_devices),
                      model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch))
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.01)
    losses = []
    for x, y in data(steps):
        losses.append(float(model.forward_backward(input_args=(x,), label=y,
                                                   loss_fn=my_loss_fn)))
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    model.synchronize()
    weights = [p.detach().clone() for p in net.parameters()]
    model.close()
    return losses, weights


def reference(steps=3):
    net = my_model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    losses = []
    for x, y in data(steps):
        loss = my_loss_fn(net(x), y)
        loss.backward()
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach().clone() for p in net.parameters()]


@pytest.fixture(scope="module")
def runs():
    return {n: train(n) for n in (1, 2, 3)}


def test_same_results_on_any_device_count_and_as_pytorch(runs):
    want_losses, want_weights = reference()
    for n, (losses, weights) in runs.items():
        assert losses == pytest.approx(want_losses, rel=RTOL), n
        for w, r in zip(weights, want_weights):
            torch.testing.assert_close(w, r, rtol=RTOL, atol=ATOL)


def test_device_counts_agree_with_each_other(runs):
    base_losses, base_weights = runs[1]
    for n in (2, 3):
        losses, weights = runs[n]
        assert losses == pytest.approx(base_losses, rel=1e-6)
        for a, b in zip(weights, base_weights):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_devices", [1, 2, 3])
def test_default_num_microbatch_is_devices_plus_one(num_devices):
    net = my_model()
    with RoundPipe(net, devices=("cpu", num_devices)) as model:
        assert model.num_devices == num_devices
        assert model.resolved_run_config().num_microbatch == num_devices + 1
        x = torch.randn(12, 8)
        out = model(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False))
        assert len(out) == num_devices + 1


def test_async_steps_run_on_several_devices():
    """The page's loop as written (asynchronous step, the default) on two devices: the loss
    falls (weights are one step stale, so the numbers are not PyTorch's step for step)."""
    net = my_model()
    model = RoundPipe(net, devices=("cpu", 2),
                      model_run_config=RoundPipeRunConfig(num_microbatch=9))
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.005)
    x, y = data(1)[0]
    losses = []
    for _ in range(20):
        losses.append(float(model.forward_backward(input_args=(x,), label=y,
                                                   loss_fn=my_loss_fn)))
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    model.synchronize()
    model.close()
    assert losses[-1] < 0.7 * losses[0]
