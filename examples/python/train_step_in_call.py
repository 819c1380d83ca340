"""Train in memory-saving mode with the optimizer step inside each training call.

    ROUNDPIPE_LIBRARY=build/libroundpipe.so PYTHONPATH=bindings/python \
        python3 examples/python/train_step_in_call.py [--devices cpu:2] [--steps 150] [--check]

`host_memory="saving"` keeps 12 bytes of host state per parameter (one weight copy, bf16 AdamW
moments); `set_step_in_call(roundpipe.optim.AdamW(...))` then makes every forward_backward also
the AdamW step over its own gradients, each parameter updated while the rest of the backward runs
(docs/semantics.md, "Steps inside the training calls"). There is no model.step() in the loop.
The task is train_mlp.py's: regress y = sin(x @ A). --check fails unless the held-out error
ends below a fifth of the first loss.
"""

import argparse
import sys
import time

import torch
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig

from train_mlp import parse_devices


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu:2", help='"cpu:2", "cuda", "auto", ...')
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    a = torch.randn(16, 8) / 4
    module = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                           nn.LayerNorm(128), nn.Linear(128, 8))
    n = args.microbatches
    model = RoundPipe(module, devices=parse_devices(args.devices), host_memory="saving",
                      model_run_config=RoundPipeRunConfig(num_microbatch=n))
    model.set_step_in_call(roundpipe.optim.AdamW(lr=3e-3))
    loss_fn = roundpipe.BuiltinLoss("mse", scale=1.0 / n)  # batch mean
    print("%r, steps inside the calls: %s" % (model, model.step_in_call))

    start, first = time.time(), None
    with model:
        for i in range(args.steps):
            x = torch.randn(args.batch, 16)
            loss = float(model.forward_backward(input_args=(x,), label=torch.sin(x @ a),
                                                loss_fn=loss_fn))
            first = loss if first is None else first
            if i % 25 == 0 or i == args.steps - 1:
                print("call %4d  loss %.5f" % (i, loss))
        model.synchronize()  # the last call's updates finish in the background
        x = torch.randn(256, 16)
        with torch.no_grad():
            test = float(nn.functional.mse_loss(model(x), torch.sin(x @ a)))
    print("held-out mse %.5f (first loss %.5f), %.1f calls/s"
          % (test, first, args.steps / (time.time() - start)))
    if args.check and not test < first / 5:
        print("check failed: the held-out error did not fall below a fifth of the first loss")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
