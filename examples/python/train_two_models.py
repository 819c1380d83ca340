"""Two RoundPipe models trained as one, upstream's encoder + decoder flow: the encoder's training
forward() feeds the decoder's forward_backward(), whose backward goes on into the encoder (the
call runs as forward() and loss.backward() because its input requires grad), and each model
takes its own optimizer step. The task: recover a fixed random teacher's outputs from noisy
inputs, which needs both models to learn.

    ROUNDPIPE_LIBRARY=build/libroundpipe.so PYTHONPATH=bindings/python \\
        python3 examples/python/train_two_models.py [--devices cpu|cuda|auto] [--steps 60] [--check]

It also asks the planner for the encoder's stages under a memory limit
(ModelExecutePlan.auto(..., model_memory_limit=...), upstream's way to force smaller stages)
and trains with that plan. --check exits with failure unless the loss falls by half and both
models' weights moved.
"""

import argparse

import torch
from torch import nn

import roundpipe
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


def mlp(sizes):
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i + 2 < len(sizes):
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu", help='"cpu" (2 CPU workers), "cuda", "auto"')
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    on_gpu = args.devices in ("cuda", "auto") and roundpipe.cuda_device_count() > 0
    devices = "cuda" if on_gpu else ("cpu", 2)

    torch.manual_seed(0)
    teacher = mlp([16, 64, 8]).requires_grad_(False)
    encoder, decoder = mlp([16, 128, 128, 64]), mlp([64, 64, 8])
    before = [p.detach().clone() for p in (*encoder.parameters(), *decoder.parameters())]
    config = RoundPipeRunConfig(num_microbatch=4)
    g = torch.Generator().manual_seed(1)
    losses = []
    with RoundPipe(encoder, devices=devices, model_run_config=config) as enc, \
            RoundPipe(decoder, devices=devices, model_run_config=config) as dec:
        # The encoder's weights and gradients (fp32) within 140 KB a stage (upstream's
        # model_memory_limit is in GiB, half of it a stage): its 128x128 layer (132 KB) gets
        # a stage of its own. The engine's planner makes the plan; the model keeps its own.
        plan = ModelExecutePlan.auto("train", enc, model_memory_limit=2 * 140e3 / 2 ** 30)
        print("encoder stages under the limit:", [list(r) for r in plan.fwd_plan])
        enc_call = RoundPipeRunConfig(execute_plan=plan)
        opt_enc = roundpipe.optim.AdamW(lr=2e-3, weight_decay=0.0)
        opt_dec = roundpipe.optim.AdamW(lr=2e-3, weight_decay=0.0)

        def loss_fn(out, target):  # per microbatch; their sum is the batch's mean error
            return ((out.float() - target.to(out.device)) ** 2).sum() / (32 * 8)

        for step in range(args.steps):
            x = torch.randn(32, 16, generator=g)
            y = teacher(x)
            noisy = x + 0.05 * torch.randn(32, 16, generator=g)
            hidden = enc(noisy, roundpipe_run_config=enc_call)  # training forward: autograd
            loss = dec.forward_backward(input_args=(hidden,), label=y, loss_fn=loss_fn)
            enc.step(opt_enc)  # the encoder's gradients came back through the decoder
            dec.step(opt_dec)
            losses.append(float(loss))
            if step % 10 == 0 or step == args.steps - 1:
                print("step %2d  loss %.5f" % (step, losses[-1]))
        enc.synchronize()
        dec.synchronize()
    after = [p.detach() for p in (*encoder.parameters(), *decoder.parameters())]
    moved = [not torch.equal(a, b) for a, b in zip(before, after)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print("loss %.5f -> %.5f; weights moved: encoder %s, decoder %s"
          % (first, last, all(moved[:6]), all(moved[6:])))
    if args.check and not (last < 0.5 * first and all(moved)):
        raise SystemExit("the loss did not fall by half or a model did not train")


if __name__ == "__main__":
    main()
