"""Timing of roundpipe.optim.Adam (torch's fused CPU Adam inside a Python step_fn) beside the
engine's built-in AdamW (C++ on the optimizer thread) on the same model. Not a test.

    ROUNDPIPE_LIBRARY=... PYTHONPATH=bindings/python python3 bench/python_optim/adam_timing.py \
        [--width 1024] [--layers 8] [--steps 10]

Each step is synchronous (step(..., is_async=False)) after one forward_backward, so both paths
include the same engine work (gradient hand-over, publishing the new weights); "update" is the
optimizer's own time (Adam.step() measured inside step_fn; for the built-in AdamW the step minus
the same engine overhead, measured with an empty step_fn).
"""

import argparse
import statistics
import time

import torch

import roundpipe
from roundpipe.optim import Adam, AdamW


def build(width, layers):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return roundpipe.RoundPipe(torch.nn.Sequential(*mods), devices=("cpu", 1))


def timed_steps(model, step, steps, x, y):
    times = []
    for i in range(steps + 2):
        model.forward_backward((x,), label=y, loss_fn="mse")
        t0 = time.perf_counter()
        model.step(step, is_async=False)
        if i >= 2:  # warm-up: state allocation
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    x = torch.randn(8, a.width)
    y = torch.randn(8, a.width)
    n = None
    results = {}
    with build(a.width, a.layers) as m:
        n = sum(p.numel() for p in m.optim_parameters())
        results["empty step_fn"] = timed_steps(m, lambda: None, a.steps, x, y)
    with build(a.width, a.layers) as m:
        results["engine AdamW"] = timed_steps(m, AdamW(lr=1e-3, weight_decay=0.01), a.steps, x, y)
    with build(a.width, a.layers) as m:
        opt = Adam(m.optim_parameters(), lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True)
        inner = []

        def step_fn():
            t0 = time.perf_counter()
            opt.step()
            inner.append(time.perf_counter() - t0)
            opt.zero_grad()
        results["roundpipe.optim.Adam"] = timed_steps(m, step_fn, a.steps, x, y)
        adam_update = statistics.median(inner[2:])
    with build(a.width, a.layers) as m:
        opt = torch.optim.Adam(m.optim_parameters(), lr=1e-3, weight_decay=0.01,
                               decoupled_weight_decay=True, foreach=True)
        results["torch.optim.Adam foreach"] = timed_steps(
            m, lambda: (opt.step(), opt.zero_grad()), a.steps, x, y)
    print("parameters: %d (%.1f M), torch threads: %d" % (n, n / 1e6, torch.get_num_threads()))
    for k, v in results.items():
        print("%-26s step %.2f ms" % (k, v * 1e3))
    base = results["empty step_fn"]
    print("update only: engine AdamW %.2f ms, roundpipe.optim.Adam %.2f ms (inside step_fn: "
          "%.2f ms)" % ((results["engine AdamW"] - base) * 1e3,
                        (results["roundpipe.optim.Adam"] - base) * 1e3, adam_update * 1e3))


if __name__ == "__main__":
    main()
