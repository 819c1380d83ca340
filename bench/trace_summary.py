#!/usr/bin/env python3
"""Summarise a RoundPipe timing record (rp_model_trace_json, Chrome trace JSON) as one JSON line.

Per device, over the steady state (from the first compute to the last compute of the call):
  compute_idle_fraction     share of that window with no compute running on the device;
  weight_upload_hidden      share of weight-upload time that overlaps compute on the same device;
  *_ms                      total time of each stream;
  *_bytes                   bytes each transfer stream moved (the sum of its events' args.bytes);
  *_waited_ms               GPUs: per stream, the time its events waited between being enqueued
                            by the host (args.enqueued_us) and starting on the device (behind
                            the stream's earlier work, an event of another stream, or a busy copy
                            engine), and *_waited_max_ms the longest such wait.
Host threads: host_ms, each thread's busy time by span kind; host_ms_after_pipeline, the part of
it after the caller's "pipeline" span ended (work the devices' time did not hide).

    python3 bench/trace_summary.py trace.json
    python3 bench/trace_summary.py --beside out/trace_*.json   # each digest to trace_*.summary.json

--beside writes each named trace's digest beside it instead of printing it, passing over names
that are digests already (*.summary.json) or do not exist (an unmatched shell glob).
"""
import json
import os
import sys


def union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def overlap(interval, merged):
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged)


def summarise(events):
    devices, moved, waited = {}, {}, {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") == "host":
            continue  # metadata and host spans: summarised below
        devices.setdefault(e["pid"], {}).setdefault(e["tid"], []).append(
            (e["ts"] / 1000.0, (e["ts"] + e["dur"]) / 1000.0))
        if "bytes" in e.get("args", {}):  # transfers carry the bytes they moved
            per_stream = moved.setdefault(e["pid"], {})
            per_stream[e["tid"]] = per_stream.get(e["tid"], 0) + e["args"]["bytes"]
        if "enqueued_us" in e.get("args", {}):  # GPUs: when the host enqueued it
            wait = max(0.0, (e["ts"] - e["args"]["enqueued_us"]) / 1000.0)
            waited.setdefault(e["pid"], {}).setdefault(e["tid"], []).append(wait)
    out = {}
    for device, streams in sorted(devices.items()):
        compute = union(streams.get("compute", []))
        if not compute:
            continue
        window = compute[-1][1] - compute[0][0]
        busy = sum(b - a for a, b in compute)
        weights = streams.get("weights", [])
        weight_ms = sum(b - a for a, b in weights)
        hidden = sum(overlap(w, compute) for w in weights)
        out[f"device{device}"] = {
            "window_ms": round(window, 3),
            "compute_idle_fraction": round(1.0 - busy / window, 4) if window > 0 else 0.0,
            "weight_upload_hidden": round(hidden / weight_ms, 4) if weight_ms > 0 else None,
            **{f"{name}_ms": round(sum(b - a for a, b in spans), 3)
               for name, spans in sorted(streams.items())},
            **{f"{name}_bytes": total for name, total in sorted(moved.get(device, {}).items())},
            **{f"{name}_waited_ms": round(sum(w), 3)
               for name, w in sorted(waited.get(device, {}).items())},
            **{f"{name}_waited_max_ms": round(max(w), 3)
               for name, w in sorted(waited.get(device, {}).items())},
        }
    host, after = {}, {}
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "host"]
    # The caller's "pipeline" span ends when the devices are done: host work after it (the
    # optimizer's in-call updates, the gradient drain) is what the call's GPUs did not hide.
    end = max((e["ts"] + e["dur"] for e in spans
               if e["tid"] == "caller" and e["name"] == "pipeline"), default=None)
    for e in spans:
        key = "%s %s" % (e["tid"], e["name"].split(" ")[0])
        host[key] = round(host.get(key, 0.0) + e["dur"] / 1000.0, 3)
        if end is not None and e["ts"] + e["dur"] > end:
            late = (e["ts"] + e["dur"] - max(e["ts"], end)) / 1000.0
            after[key] = round(after.get(key, 0.0) + late, 3)
    if host:
        out["host_ms"] = host
    if after:
        out["host_ms_after_pipeline"] = after
    return out


def digest(path):
    with open(path) as f:
        return json.dumps(summarise(json.load(f)["traceEvents"]))


def main():
    if sys.argv[1] != "--beside":
        print(digest(sys.argv[1]))
        return
    for path in sys.argv[2:]:
        if path.endswith(".summary.json") or not os.path.isfile(path):
            continue
        with open(path[:-len(".json")] + ".summary.json", "w") as f:
            f.write(digest(path) + "\n")


if __name__ == "__main__":
    main()
