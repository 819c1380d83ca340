"""Data parallelism: several processes (ranks) train one model, each on its share of every batch,
each with its own RoundPipe pipeline; the engine averages their gradients before every step.

    ROUNDPIPE_LIBRARY=build/libroundpipe.so PYTHONPATH=bindings/python \
        python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        examples/python/train_data_parallel.py [--devices cpu:2] [--steps 200] [--check]

One machine with 2 GPUs: --devices cuda:1 (each rank sees its own GPU: torchrun sets LOCAL_RANK
and this script sets CUDA_VISIBLE_DEVICES from it before the library loads). Several machines:
torchrun --nnodes N --node_rank K --master_addr HOST0 --master_port 29500 (docs/several-machines.md).

The task is examples/python/train_mlp.py's: regress y = sin(x @ A). Every rank draws the same
global batch and takes its rows; rank 0 prints the loss averaged over the ranks and saves the
weights. --check fails (exit 1) unless the loss falls by half and both ranks end with the same
weights.
"""

import argparse
import os
import sys

if os.environ.get("LOCAL_RANK") is not None and "cuda" in " ".join(sys.argv):
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", os.environ["LOCAL_RANK"])

import torch  # noqa: E402
from torch import nn  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402


def parse_devices(text):
    kind, _, count = text.partition(":")
    return (kind, int(count or 0))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu:2", help='"cpu:2", "cuda:1", ...')
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="global batch, split over ranks")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--out", default="data_parallel_weights.safetensors")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    a = torch.randn(16, 8) / 4
    # Each rank may build its module from any seed: before the first training call every rank
    # takes rank 0's weights.
    module = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                           nn.LayerNorm(128), nn.Linear(128, 8))
    n = args.microbatches
    model = RoundPipe(module, devices=parse_devices(args.devices), name="train_data_parallel",
                      data_parallel=roundpipe.DataParallel(global_loss=True),
                      model_run_config=RoundPipeRunConfig(num_microbatch=n))
    rank, world = model.rank, model.world_size  # the engine's answers
    if args.batch % world:
        sys.exit("--batch must be a multiple of the number of ranks")
    rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    if rank == 0:
        print("%r: rank %d of %d" % (model, rank, world))

    step = roundpipe.optim.AdamW(lr=3e-3)
    loss_fn = roundpipe.BuiltinLoss("mse", scale=1.0 / n)  # the mean over this rank's rows
    data = torch.Generator().manual_seed(1)  # the same global batches on every rank
    losses = []
    with model:
        for i in range(args.steps):
            x = torch.randn(args.batch, 16, generator=data)
            y = torch.sin(x @ a)
            loss = model.forward_backward(input_args=(x[rows],), label=y[rows], loss_fn=loss_fn)
            model.step(step)  # async; the gradients were averaged over the ranks first
            losses.append(float(loss))  # the mean over the ranks (global_loss=True)
            if rank == 0 and (i % 20 == 0 or i == args.steps - 1):
                print("step %4d  loss %.5f" % (i, losses[-1]))
        model.synchronize()
        model.save(args.out)  # rank 0 writes; the others return at once
        if args.check:
            import torch.distributed as dist  # only to compare the ranks' weights here
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            weights = torch.cat([p.detach().reshape(-1) for p in model.optim_parameters()])
            everyone = [torch.empty_like(weights) for _ in range(world)]
            dist.all_gather(everyone, weights)
            same = all(torch.equal(everyone[0], w) for w in everyone)
            fell = losses[-1] < 0.5 * losses[0]
            if rank == 0:
                print("loss %.4f -> %.4f; ranks hold the same weights: %s" % (losses[0], losses[-1],
                                                                            same))
            if not (same and fell):
                sys.exit(1)


if __name__ == "__main__":
    main()
