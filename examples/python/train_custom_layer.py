"""Your own nn.Module trains with RoundPipe: a small residual convolutional network, written in
plain PyTorch, learns to tell two kinds of synthetic 16x16 images apart. Modules the engine has
no layer for (Conv2d, BatchNorm2d, the ResBlock below) run as Python layers: the engine owns
their weights, streams them to the worker devices and trains them; the binding runs your
forward with torch and back-propagates with autograd.

    ROUNDPIPE_LIBRARY=build/libroundpipe.so PYTHONPATH=bindings/python \\
        python3 examples/python/train_custom_layer.py [--devices cpu|cuda|auto] [--steps 30]

CPU by default (two CPU worker devices); --devices cuda trains on the GPUs in bf16 (weights
held in fp32 by the engine). Exits with failure unless the loss falls by half.
"""

import argparse

import torch
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig


class ResBlock(nn.Module):
    """conv - BN - ReLU - conv - BN, plus the input: any module works, not only the engine's."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


def build(channels=16, classes=2):
    # An nn.Sequential: its children are RoundPipe's layers, spread over the worker devices.
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
        ResBlock(channels), ResBlock(channels),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


def make_batch(n, g):
    """Class 0: horizontal stripes, class 1: vertical stripes, random phase, plus noise."""
    labels = torch.randint(0, 2, (n,), generator=g)
    phase = torch.randint(0, 4, (n, 1, 1), generator=g)
    rows = torch.arange(16).view(1, 16, 1).expand(n, 16, 16)
    cols = torch.arange(16).view(1, 1, 16).expand(n, 16, 16)
    coord = torch.where(labels.view(n, 1, 1) == 0, rows, cols)
    images = (((coord + phase) // 2) % 2).float() * 2 - 1
    images = images + 0.5 * torch.randn(n, 16, 16, generator=g)
    return images.unsqueeze(1), labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu", help='"cpu" (2 CPU workers), "cuda", "auto"')
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    on_gpu = args.devices in ("cuda", "auto") and roundpipe.cuda_device_count() > 0
    devices = ("cpu", 2) if not on_gpu else "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32

    torch.manual_seed(0)
    net = build().to(dtype)
    model = RoundPipe(net, optim_dtype=torch.float32, devices=devices,
                      model_run_config=RoundPipeRunConfig(num_microbatch=4))
    print("%r, library %s" % (model, roundpipe.library_version()))
    optimizer = roundpipe.optim.AdamW(lr=3e-3, weight_decay=0.0)
    criterion = nn.CrossEntropyLoss()

    def loss_fn(logits, labels):  # runs on the device of the last stage, with autograd
        return criterion(logits.float(), labels) / 4  # mean over the 4 microbatches

    g = torch.Generator().manual_seed(1)
    losses = []
    with model:
        for step in range(args.steps):
            images, labels = make_batch(args.batch, g)
            loss = model.forward_backward((images.to(dtype),), label=labels, loss_fn=loss_fn)
            model.step(optimizer)  # async: overlaps the next forward_backward
            losses.append(float(loss))
            if step % 5 == 0 or step == args.steps - 1:
                print("step %2d  loss %.4f" % (step, losses[-1]))
        model.synchronize()  # net now holds the trained weights and BatchNorm statistics
        images, labels = make_batch(256, g)
        with torch.no_grad():
            accuracy = (model(images.to(dtype)).argmax(-1) == labels).float().mean().item()
    print("accuracy on 256 new images: %.3f" % accuracy)
    net.eval()
    with torch.no_grad():  # the module itself, outside RoundPipe, gives the same predictions
        plain = (net.cpu()(images.to(dtype)).argmax(-1) == labels).float().mean().item()
    print("the plain module after synchronize(): accuracy %.3f" % plain)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    if not last < 0.5 * first:
        raise SystemExit("the loss did not fall by half (%.4f -> %.4f)" % (first, last))


if __name__ == "__main__":
    main()
