#!/usr/bin/env python3
"""Draw a training run's loss curve as a PNG with matplotlib.

The tiny language-model examples (examples/c/train_tiny_lm.c, examples/python/train_tiny_lm.py)
write their losses as CSV (a "step,loss" header, then one row per step) and call this to draw
them: C has no plotting library, so the C example runs this script.

    python3 examples/python/plot_loss.py losses.csv loss.png [--title TEXT]
"""
import argparse
import csv


def read_losses(path):
    """(steps, losses) of a "step,loss" CSV file."""
    steps, losses = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            steps.append(int(row["step"]))
            losses.append(float(row["loss"]))
    return steps, losses


def plot_losses(steps, losses, png, title=""):
    """Write the loss per step, its running mean over 10 steps and the line at half the first
    loss to `png`."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    window = 10
    mean = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.8, alpha=0.4, color="#4c72b0", label="loss of the step")
    ax.plot(steps, mean, lw=2, color="#4c72b0", label="mean of the last %d steps" % window)
    if losses:
        ax.axhline(losses[0] / 2, ls="--", lw=1, color="#c44e52", label="half the first loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="losses, as written by the examples")
    p.add_argument("png", help="the plot to write")
    p.add_argument("--title", default="")
    a = p.parse_args()
    steps, losses = read_losses(a.csv)
    plot_losses(steps, losses, a.png, a.title)


if __name__ == "__main__":
    main()
