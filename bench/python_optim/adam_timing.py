"""Timing of roundpipe.optim.Adam (the engine's AdamW kernel through rp_adam_apply, inside a
Python step_fn) beside the engine's built-in AdamW (C++ on the optimizer thread) on the same
model. Not a test. The last line is JSON: `ratio_engine_over_adam_step` (whole synchronous
steps, per round) and `ratio_engine_over_adam_update` (each minus the empty step_fn's step) >= 1
mean roundpipe.optim.Adam is at least as fast as the built-in AdamW; the built-in path runs no
Python at all, so these include the cost of any Python step_fn (the GIL, the .grad views).
`ratio_kernel_over_adam_inside_step_fn` compares Adam.step() with one bare rp_adam_apply over
the same parameters inside the same kind of step_fn: what the Python optimizer adds to the
kernel.

    ROUNDPIPE_LIBRARY=... PYTHONPATH=bindings/python python3 bench/python_optim/adam_timing.py \
        [--width 1024] [--layers 8] [--steps 30]

Each step is synchronous (step(..., is_async=False)) after one forward_backward, so both paths
include the same engine work (gradient hand-over, publishing the new weights); "update" is the
optimizer's own time (Adam.step() measured inside step_fn; for the built-in AdamW the step minus
the same engine overhead, measured with an empty step_fn). The four models take their steps in
turns, one each per round, and the ratios are medians of per-round pairs, so that load from
other processes falls on all of them alike.
"""

import argparse
import json
import statistics
import time

from ctypes import c_int64

import torch

import roundpipe
from roundpipe import _capi
from roundpipe.optim import Adam, AdamW

try:  # absent from packages older than rp_adam_apply (for comparing them)
    from roundpipe.optim import _dlpack_array
except ImportError:
    _dlpack_array = None


def build(width, layers):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return roundpipe.RoundPipe(torch.nn.Sequential(*mods), devices=("cpu", 1))


def timed_step(model, step, x, y):
    model.forward_backward((x,), label=y, loss_fn="mse")
    t0 = time.perf_counter()
    model.step(step, is_async=False)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    x = torch.randn(8, a.width)
    y = torch.randn(8, a.width)
    names = ("empty step_fn", "engine AdamW", "roundpipe.optim.Adam", "torch.optim.Adam foreach")
    if _dlpack_array is not None:
        names += ("rp_adam_apply direct",)
    models = {k: build(a.width, a.layers) for k in names}
    n = sum(p.numel() for p in models["engine AdamW"].optim_parameters())
    inner = []
    adam = Adam(models["roundpipe.optim.Adam"].optim_parameters(), lr=1e-3, weight_decay=0.01,
                decoupled_weight_decay=True)

    def adam_step():
        t0 = time.perf_counter()
        adam.step()
        inner.append(time.perf_counter() - t0)
        adam.zero_grad()

    # The engine's kernel with no Python optimizer around it: one rp_adam_apply over every
    # parameter, inside a step_fn like Adam's (same thread, same context), on its own state.
    direct_model = models.get("rp_adam_apply direct")
    direct_params = list(direct_model.optim_parameters()) if direct_model else []
    direct_state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in direct_params]
    direct_steps = [0]
    direct_inner = []

    def direct_step():
        t0 = time.perf_counter()
        direct_steps[0] += 1
        keep = []
        arrays = [_dlpack_array(ts, keep) for ts in (
            direct_params, [p.grad for p in direct_params], [m for m, _ in direct_state],
            [v for _, v in direct_state])]
        n_t = len(direct_params)
        _capi.lib().rp_adam_apply(*arrays, (c_int64 * n_t)(*([direct_steps[0]] * n_t)), n_t,
                                  1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
        direct_inner.append(time.perf_counter() - t0)

    foreach = torch.optim.Adam(models["torch.optim.Adam foreach"].optim_parameters(), lr=1e-3,
                               weight_decay=0.01, decoupled_weight_decay=True, foreach=True)
    steps = {"empty step_fn": lambda: None,
             "engine AdamW": AdamW(lr=1e-3, weight_decay=0.01),
             "roundpipe.optim.Adam": adam_step,
             "torch.optim.Adam foreach": lambda: (foreach.step(), foreach.zero_grad()),
             "rp_adam_apply direct": direct_step}
    samples = {k: [] for k in names}
    for i in range(a.steps + 2):
        # One step of each model in turn: load from other processes falls on all alike.
        for k in names:
            t = timed_step(models[k], steps[k], x, y)
            if i >= 2:  # warm-up: state allocation
                samples[k].append(t)
    for m in models.values():
        m.close()
    inner = inner[2:]
    direct_inner = direct_inner[2:]
    kernel_ratios = [d / a for d, a in zip(direct_inner, inner)] or [float("nan")]
    direct_inner = direct_inner or [float("nan")]
    med = {k: statistics.median(v) for k, v in samples.items()}
    # Paired per round: each model's step minus the empty step_fn's of the same round.
    engine = statistics.median(e - b for e, b in zip(samples["engine AdamW"],
                                                      samples["empty step_fn"]))
    ours = statistics.median(o - b for o, b in zip(samples["roundpipe.optim.Adam"],
                                                    samples["empty step_fn"]))
    ratios = [e / o for e, o in zip(samples["engine AdamW"], samples["roundpipe.optim.Adam"])]
    print("parameters: %d (%.1f M), torch threads: %d" % (n, n / 1e6, torch.get_num_threads()))
    for k, v in med.items():
        print("%-26s step %.2f ms" % (k, v * 1e3))
    print("update only: engine AdamW %.2f ms, roundpipe.optim.Adam %.2f ms (inside step_fn: "
          "%.2f ms)" % (engine * 1e3, ours * 1e3, statistics.median(inner) * 1e3))
    print(json.dumps({
        "bench": "python_optim", "params": n, "torch_threads": torch.get_num_threads(),
        "steps": a.steps,
        "step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
        "engine_adamw_update_ms": round(engine * 1e3, 3),
        "adam_update_ms": round(ours * 1e3, 3),
        "adam_step_inside_step_fn_ms": round(statistics.median(inner) * 1e3, 3),
        "ratio_engine_over_adam_step": round(statistics.median(ratios), 3),
        "ratio_engine_over_adam_update": round(engine / ours, 3) if ours > 0 else None,
        "kernel_direct_inside_step_fn_ms": round(statistics.median(direct_inner) * 1e3, 3),
        "ratio_kernel_over_adam_inside_step_fn": round(statistics.median(kernel_ratios), 3),
    }))


if __name__ == "__main__":
    main()
