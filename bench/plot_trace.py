#!/usr/bin/env python3
"""Draw a RoundPipe timing record (rp_model_trace_json) as a timeline PNG: one row per device
stream (weights, activation uploads, compute, download) and per host thread (caller,
gradients, optimizer). Devices are labelled from the trace's process names ("cuda:0" -> GPU 0,
"cpu 1" -> CPU 1). Needs matplotlib (scripts/setup.sh installs it).

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


def device_label(name, pid):
    """"GPU 0" for "cuda:0", "CPU 1" for "cpu 1" (the trace's process names); "device <pid>" for
    a trace without them."""
    if name.startswith("cuda:"):
        return "GPU " + name[len("cuda:"):]
    if name.startswith("cpu "):
        return "CPU " + name[len("cpu "):]
    return name or "device %s" % pid


def rows_of(trace):
    """(rows, labels): (device pid, stream) per device stream, then ("host", thread)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    devices = sorted({e["pid"] for e in events if e.get("cat") != "host"})
    rows = [(d, s) for d in devices for s in STREAMS] + [("host", h) for h in HOST]
    labels = ["%s %s" % (device_label(names.get(r[0], ""), r[0]), r[1]) if r[0] != "host"
              else "host %s" % r[1] for r in rows]
    return rows, labels


def row_labels(trace):
    """The label of every row, top to bottom."""
    return rows_of(trace)[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("png")
    p.add_argument("--title", default="")
    a = p.parse_args()
    with open(a.trace) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    rows, labels = rows_of(trace)
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.2))
    for e in events:
        key = ("host", e["tid"]) if e.get("cat") == "host" else (e["pid"], e["tid"])
        if key not in index:
            continue
        ax.broken_barh([(e["ts"] / 1000.0, max(e["dur"] / 1000.0, 0.05))], (index[key] - 0.4, 0.8),
                       facecolors=COLOURS.get(key[1], "#333333"), edgecolor="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the call started")
    if a.title:
        ax.set_title(a.title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
