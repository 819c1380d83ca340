"""Upstream's tutorial "Train a Custom Model" (ResNet on CIFAR-100), runnable offline.

The code follows upstream's UserGuide_QuickStart_resnet_cifar100 page as written: the ResNet as
an nn.Sequential, ``RoundPipe(model.to(torch.float16), optim_dtype=torch.float32)``, the
optimizer created in ``OptimizerCtx()`` as ``roundpipe.optim.Adam``, a ``GradScaler``,
``forward_backward(..., return_outputs=True)`` with the scaled loss, ``model.step(...)`` then
``scaler.update()``, ``synchronize()`` before evaluating. Two things differ:

- data: synthetic CIFAR-shaped images (3x32x32, 100 classes), a learnable pattern per class
  plus noise, instead of torchvision's download;
- size, for CI on CPU workers: ``--width`` scales the channel widths (tutorial: 32, i.e.
  32 -> 64 -> 128 -> 256 -> 512) and ``--blocks`` the blocks per group (tutorial: 3,4,6,3).
  ``--full`` gives the tutorial's network and 20 epochs.

        python3 examples/python/tutorial_resnet_cifar100.py [--devices cpu|cuda|auto] [--full]

On CPU workers the model runs in fp32 unless --fp16 (float16 convolutions on a CPU are slow),
on GPUs in fp16 as the tutorial does. The script asserts that the training loss falls.
"""

import argparse
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import roundpipe
from roundpipe import RoundPipe, OptimizerCtx, GradScaler
from roundpipe.optim import Adam


# ResNet Basic Block (the tutorial's code)
class BasicBlock(nn.Module):
    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


def make_blocks(in_channels, out_channels, blocks, stride):
    layers = []
    layers.append(BasicBlock(in_channels, out_channels, stride))
    for _ in range(1, blocks):
        layers.append(BasicBlock(out_channels, out_channels))
    return layers


def build_resnet(num_classes=100, width=32, blocks=(3, 4, 6, 3)):
    """The tutorial's build_resnet; width=32, blocks=(3, 4, 6, 3) are its sizes."""
    w = width
    layers = [
        nn.Conv2d(3, w, 3, 1, 1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        *make_blocks(w, 2 * w, blocks[0], 2),
        *make_blocks(2 * w, 4 * w, blocks[1], 2),
        *make_blocks(4 * w, 8 * w, blocks[2], 2),
        *make_blocks(8 * w, 16 * w, blocks[3], 2),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(16 * w, num_classes),
    ]
    return nn.Sequential(*layers)


def synthetic_cifar100(n, seed, num_classes=100):
    """CIFAR-shaped data: each class a fixed random 3x32x32 pattern, each image its class's
    pattern plus noise, normalised as the tutorial's transforms would leave it."""
    g = torch.Generator().manual_seed(1234)
    patterns = torch.randn(num_classes, 3, 32, 32, generator=g)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    images = patterns[labels] + 0.8 * torch.randn(n, 3, 32, 32, generator=g)
    return TensorDataset(images, labels)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu", help='"cpu" (2 CPU workers), "cuda", "auto"')
    parser.add_argument("--full", action="store_true", help="the tutorial's sizes, 20 epochs")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--blocks", default="1,1,1,1")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train", type=int, default=320, help="synthetic training images")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fp16", action="store_true", help="fp16 on CPU workers too")
    args = parser.parse_args(argv)
    if args.full:
        args.width, args.blocks, args.epochs, args.train, args.batch = \
            32, "3,4,6,3", 20, 50000, 128
    on_gpu = args.devices in ("cuda", "auto") and roundpipe.cuda_device_count() > 0
    devices = "cuda" if on_gpu else ("cpu", 2)
    dtype = torch.float16 if on_gpu or args.fp16 else torch.float32
    torch.manual_seed(0)

    # 3. Data (synthetic, see above)
    trainset = synthetic_cifar100(args.train, seed=1)
    testset = synthetic_cifar100(max(args.batch, args.train // 5), seed=2)
    trainloader = DataLoader(trainset, batch_size=args.batch, shuffle=True, drop_last=True)
    testloader = DataLoader(testset, batch_size=args.batch, shuffle=False)

    # 4. Wrap the model with RoundPipe (the tutorial's code; devices= picks CPU workers here)
    blocks = tuple(int(b) for b in args.blocks.split(","))
    model = RoundPipe(build_resnet(width=args.width, blocks=blocks).to(dtype),
                      optim_dtype=torch.float32, devices=devices)

    with OptimizerCtx():
        optimizer = Adam(model.parameters())

    scaler = GradScaler()
    criterion = nn.CrossEntropyLoss()
    num_microbatch = model.resolved_run_config().num_microbatch
    print(model, "num_microbatch", num_microbatch, "dtype", dtype)

    # 5. Evaluation function (the tutorial's code)
    def evaluate(loader):
        model.synchronize()
        model.eval()
        correct, total, loss_sum = 0, 0, 0
        with torch.no_grad():
            for images, labels in loader:
                images, labels = images.to(dtype), labels
                outputs = model(images)
                loss = criterion(outputs.float(), labels)
                loss_sum += loss.item() * labels.size(0)
                _, predicted = outputs.max(1)
                correct += predicted.eq(labels).sum().item()
                total += labels.size(0)
        return loss_sum / total, correct / total

    # 6. Training loop (the tutorial's code; the loss is divided by the number of
    # microbatches, which the tutorial writes as torch.cuda.device_count() + 1, the default
    # num_microbatch on GPUs)
    train_losses, test_losses = [], []

    def optimizer_step():
        scaler.step(optimizer)
        optimizer.zero_grad()

    start = time.time()
    for epoch in range(args.epochs):
        model.train()
        running_loss, correct, total = 0, 0, 0
        for images, labels in trainloader:
            loss, outputs = model.forward_backward(
                input_args=(images.to(dtype),),
                label=labels,
                loss_fn=lambda outputs, labels: scaler.scale(
                    criterion(outputs.float(), labels)
                ) / num_microbatch,
                return_outputs=True,
            )
            model.step(optimizer_step)
            scaler.update()

            loss_item = loss.item() / scaler.get_scale()
            running_loss += loss_item * labels.size(0)
            _, predicted = outputs.max(1)
            correct += predicted.eq(labels).sum().item()
            total += labels.size(0)

        train_loss = running_loss / total
        test_loss, test_acc = evaluate(testloader)
        train_losses.append(train_loss)
        test_losses.append(test_loss)
        print("Epoch %02d/%d | Train Loss: %.4f | Train Acc: %.4f | Test Loss: %.4f | "
              "Test Acc: %.4f | %.1fs" % (epoch + 1, args.epochs, train_loss, correct / total,
                                          test_loss, test_acc, time.time() - start))
    model.close()
    if not train_losses[-1] < train_losses[0]:
        raise SystemExit("the training loss did not fall: %s" % train_losses)
    print("loss fell: %.4f -> %.4f" % (train_losses[0], train_losses[-1]))
    return train_losses


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
