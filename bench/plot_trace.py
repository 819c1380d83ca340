#!/usr/bin/env python3
"""Draw a RoundPipe timing record (rp_model_trace_json) as a timeline PNG: one row per device
stream (weights, activation uploads, compute, download) and per host thread (caller,
gradients, optimizer). Needs matplotlib (pip install matplotlib); nothing else uses it.

    python3 bench/plot_trace.py trace.json out.png [--title TEXT]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STREAMS = ["weights", "activation_upload", "compute", "download"]
HOST = ["caller", "gradients", "optimizer"]
COLOURS = {"weights": "#4c72b0", "activation_upload": "#8172b2", "compute": "#55a868",
           "download": "#c44e52", "caller": "#937860", "gradients": "#da8bc3",
           "optimizer": "#8c8c8c"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("png")
    p.add_argument("--title", default="")
    a = p.parse_args()
    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X"]
    devices = sorted({e["pid"] for e in events if e.get("cat") != "host"})
    rows = [(d, s) for d in devices for s in STREAMS] + [("host", h) for h in HOST]
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.2))
    for e in events:
        key = ("host", e["tid"]) if e.get("cat") == "host" else (e["pid"], e["tid"])
        if key not in index:
            continue
        ax.broken_barh([(e["ts"] / 1000.0, max(e["dur"] / 1000.0, 0.05))], (index[key] - 0.4, 0.8),
                       facecolors=COLOURS.get(key[1], "#333333"), edgecolor="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["GPU %s %s" % r if r[0] != "host" else "host %s" % r[1] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the call started")
    if a.title:
        ax.set_title(a.title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
