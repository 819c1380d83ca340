"""No leak: 1,000 create/destroy cycles and 1,000 training steps keep the process's memory flat.

Measure: resident set size from /proc/self/statm, after a warm-up (allocator pools, libtorch
lazy init, thread stacks reused), then after 1,000 more iterations.
Bound: growth <= 8 MiB over the 1,000 iterations. Measured on the CPU build: 0.04 MiB for the
cycles, 0.1 MiB for built-in steps, 0.3 MiB for Python loss + torch.optim steps.
What the bound catches: each model below holds about 64 KiB of parameters per copy and the
engine keeps at least three copies (master, compute, gradient), so leaking a model per cycle
adds >= 190 MiB; leaking per step the DLPack views of the gradients (up to 32 KiB each, six per
step), an output or a split piece adds tens of megabytes or more. The binding's registry of
Python callbacks must also be empty afterwards. The bound leaves room for allocator
fragmentation, which is not a leak.
"""

import gc
import os

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe._callbacks import registry  # noqa: E402

DEVICES = ("cpu", 2)
ITERATIONS = 1000
WARMUP = 50
BOUND_MIB = 8
SPEC = {"layers": [{"type": "linear", "in": 64, "out": 128}, {"type": "relu"},
                   {"type": "linear", "in": 128, "out": 64}, {"type": "tanh"},
                   {"type": "linear", "in": 64, "out": 4}]}

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"),
                                reason="needs /proc/self/statm to read the RSS")


def rss_mib():
    gc.collect()
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_create_destroy_cycles_do_not_leak():
    x = torch.randn(6, 64)

    def cycle():
        model = roundpipe.RoundPipe(SPEC, devices=DEVICES)
        model(x)
        params = list(model.optim_parameters())  # DLPack views of the master weights
        model.close()
        del params

    for _ in range(WARMUP):
        cycle()
    before = rss_mib()
    for _ in range(ITERATIONS):
        cycle()
    growth = rss_mib() - before
    assert growth <= BOUND_MIB, "RSS grew %.1f MiB over %d create/destroy cycles" % (
        growth, ITERATIONS)
    assert len(registry) == 0


@pytest.mark.parametrize("path", ["builtin", "python"])
def test_training_steps_do_not_leak(path):
    with roundpipe.RoundPipe(SPEC, devices=DEVICES) as model:
        x, y = torch.randn(6, 64), torch.randn(6, 4)
        if path == "builtin":
            opt = roundpipe.optim.AdamW(lr=1e-4)

            def one():
                model.forward_backward((x,), label=y, loss_fn="mse")
                model.step(opt)
        else:
            opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-4)

            def step_fn():
                opt.step()
                opt.zero_grad()

            def one():
                _, out = model.forward_backward(
                    (x,), label=y, return_outputs=True,
                    loss_fn=lambda o, lab: torch.nn.functional.mse_loss(o, lab))
                model.step(step_fn)

        for _ in range(WARMUP):
            one()
        model.synchronize()
        before = rss_mib()
        for _ in range(ITERATIONS):
            one()
        model.synchronize()
        growth = rss_mib() - before
        assert model.step_count == WARMUP + ITERATIONS
    assert growth <= BOUND_MIB, "RSS grew %.1f MiB over %d %s steps" % (growth, ITERATIONS, path)
    assert len(registry) == 0
