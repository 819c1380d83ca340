"""Worker of test_data_parallel.py, one per rank, launched by torchrun:

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_worker.py MODE OUT

MODE:
  env   the JSON-spec model, engine seed = rank (every rank must train from rank 0's weights),
        built-in AdamW and MSE loss, DataParallel() from torchrun's environment; each rank also
        calls save(OUT.rank<r>.safetensors): only rank 0's must appear.
  pg    an nn.Sequential built after torch.manual_seed(rank) (its weights, copied in after
        creation, must be replaced by rank 0's), torch.optim.AdamW in a Python step_fn, a
        Python loss_fn, DataParallel.from_process_group() after init_process_group("gloo").
  die   rank 1 dies (os._exit) after two steps; rank 0's next calls must fail (IO, then STATE).

Each rank trains on its half of a fixed 8-row batch (rank r: rows [4r, 4r + 4)) in 2
microbatches, 10 synchronous then 10 asynchronous steps, global loss on, and writes
torch.save({"rank", "world_size", "losses", "state"}) to OUT.rank<r> (the `die` mode: what it saw).
The functions here are also the single-process reference of the test (whole batch, 4
microbatches: the same rows per microbatch).
"""

import os
import sys

import torch

import roundpipe

BATCH, IN, OUT = 8, 8, 4
SYNC_STEPS = ASYNC_STEPS = 10
NAME = "dp_test"
SPEC = {"layers": [
    {"type": "linear", "in": IN, "out": 16},
    {"type": "tanh"},
    {"type": "linear", "in": 16, "out": OUT},
]}


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def build(kind, num_microbatch, seed, data_parallel=None):
    """`kind` "spec": the JSON spec, weights from the engine's `seed`; "module": an
    nn.Sequential built after torch.manual_seed(seed), its weights copied in."""
    config = roundpipe.RoundPipeRunConfig(num_microbatch=num_microbatch)
    if kind == "spec":
        model = SPEC
    else:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, OUT))
    return roundpipe.RoundPipe(model, name=NAME, devices=("cpu", 2), seed=seed,
                               model_run_config=config, data_parallel=data_parallel)


def train(model, kind, rows, num_microbatch, steps=SYNC_STEPS + ASYNC_STEPS, on_step=None):
    """The training loop; the loss of each call is the mean over its rows (each microbatch's
    MSE over the number of microbatches). Returns the losses and the final state dict."""
    if kind == "spec":
        step_fn = roundpipe.optim.AdamW(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)
        loss_fn = roundpipe.BuiltinLoss("mse", scale=1.0 / num_microbatch)
    else:
        opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-2, weight_decay=0.05)

        def step_fn():
            opt.step()
            opt.zero_grad()

        def loss_fn(out, y):
            return torch.nn.functional.mse_loss(out, y) / num_microbatch
    losses = []
    for s in range(steps):
        if on_step is not None:
            on_step(s)
        x, y = data(s)
        losses.append(float(model.forward_backward((x[rows],), label=y[rows], loss_fn=loss_fn)))
        model.step(step_fn, is_async=s >= SYNC_STEPS)
    model.synchronize()
    return losses, model.state_dict()


def main(mode, out):
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if mode == "pg":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dp = roundpipe.DataParallel.from_process_group(timeout=60, global_loss=True)
        assert dp.rendezvous.startswith("tcp://127.0.0.1:"), dp
        kind, seed = "module", rank  # the first training call must share rank 0's weights
    elif mode == "die":
        dp = roundpipe.DataParallel(timeout=10, global_loss=True)
        kind, seed = "spec", 0
    else:
        dp = roundpipe.DataParallel(global_loss=True, timeout=60)
        kind, seed = "spec", rank  # the first training call must share rank 0's weights
    model = build(kind, 2, seed, dp)
    result = {"rank": model.rank, "world_size": model.world_size}
    rows = slice(4 * model.rank, 4 * model.rank + 4)
    if mode == "die":
        def on_step(s):
            if s == 2 and model.rank == 1:
                os._exit(0)  # no goodbye: the peer sees a dead connection or a timeout
        errors = []
        try:
            train(model, kind, rows, 2, on_step=on_step)
        except roundpipe.RoundPipeError as e:
            errors.append((int(e.status), str(e)))
        try:
            train(model, kind, rows, 2, steps=1)
        except roundpipe.RoundPipeError as e:
            errors.append((int(e.status), str(e)))
        result["errors"] = errors
        torch.save(result, "%s.rank%d" % (out, model.rank))
        os._exit(0)  # the group is broken: skip the model's teardown
    result["losses"], result["state"] = train(model, kind, rows, 2)
    if mode == "env":
        model.save("%s.rank%d.safetensors" % (out, model.rank))
    torch.save(result, "%s.rank%d" % (out, model.rank))
    model.close()
    if mode == "pg":
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
