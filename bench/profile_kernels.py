#!/usr/bin/env python3
"""Per-kernel GPU profile of one training iteration: ours and the plain PyTorch baseline.

    ROUNDPIPE_LIBRARY=build-gpu/libroundpipe.so PYTHONPATH=bindings/python \
        python3 bench/profile_kernels.py                      # Qwen3-1.7B, 8 x 4096, one H200
    ... --gpu-cap-gib 10 --microbatches 8 --grain layer       # the capped configuration
    ... --batch 1 --seq 65536 --microbatches 1 --paths ours   # one long sequence

The model is the one of bench/python_layers/qwen3_python_layers_bench.py (its builder is reused:
transformers' Qwen3ForCausalLM with Qwen3-1.7B's shape, random weights, bf16), on random tokens
whose labels are the inputs.

* ``ours``: ``wrap_model_to_roundpipe(model)`` (the engine's native Qwen3 layers, fused chunked
  causal-LM loss), ``forward_backward`` + an asynchronous built-in AdamW ``step``.
* ``baseline``: the same module in plain PyTorch with everything on the GPU, as bench/train's
  libtorch baseline runs it: fp32 weights, bf16 autocast, transformers' own ``labels=`` loss,
  gradient accumulation over the microbatches, fused ``torch.optim.AdamW``, no checkpointing.

Each path runs ``--warmup`` iterations, then one iteration under ``torch.profiler`` (CUDA
activity: CUPTI sees every kernel of the process, the engine's libtorch included, since the
library uses the libtorch of this Python's torch). The table lists each kernel's self GPU time,
calls and share of the iteration's kernel time, and a summary by kind (GEMM, attention,
elementwise, reduction, copies). Copies (Memcpy) run on the engine's transfer streams beside the
compute and are listed apart from kernel time.

Prints the tables on stdout and, last, one JSON line {"profile_kernels": {...}} with every figure.
"""

import argparse
import gc
import importlib.util
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))

import torch  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402


def _load_model_builder():
    spec = importlib.util.spec_from_file_location(
        "qwen3_python_layers_bench",
        os.path.join(HERE, "python_layers", "qwen3_python_layers_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILDER = _load_model_builder()

# Kinds of kernels, by name; the first pattern that matches wins.
KINDS = [
    ("ours", re.compile(r"rp::kernels")),  # src/kernels: fused RMSNorm, RoPE, SwiGLU, loss
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|splitk", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|logsumexp|scan", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|index|gather|scatter|"
                               r"copy|fill|cat|embedding", re.I)),
]


def log(msg):
    print("[profile_kernels] %s" % msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--grain", choices=("stage", "layer"), default="stage")
    p.add_argument("--gpu-cap-gib", type=float, default=None,
                   help="the engine's GPU memory cap (default: the engine's own)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="kernels listed per path")
    p.add_argument("--paths", default="ours,baseline")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke run)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.paths = [x for x in args.paths.split(",") if x]
    for x in args.paths:
        if x not in ("ours", "baseline"):
            p.error("unknown path %r" % x)
    # Fields the shared model builder reads.
    args.dtype = "bf16"
    return args


def kind_of(name):
    if name.startswith("Memcpy") or name.startswith("Memset"):
        return "copy"
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def kernel_table(prof, iter_ms, top):
    """Kernels of a finished profile: [{name, kind, calls, self_ms, share}], sorted by time."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t <= 0 or getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        rows.append({"name": e.key, "kind": kind_of(e.key), "calls": e.count,
                     "self_ms": t / 1e3})
    kernels = [r for r in rows if r["kind"] != "copy"]
    copies = [r for r in rows if r["kind"] == "copy"]
    kernel_ms = sum(r["self_ms"] for r in kernels)
    for r in rows:
        r["share"] = r["self_ms"] / kernel_ms if kernel_ms > 0 and r["kind"] != "copy" else None
    kernels.sort(key=lambda r: -r["self_ms"])
    by_kind = {}
    for r in kernels:
        k = by_kind.setdefault(r["kind"], {"self_ms": 0.0, "calls": 0})
        k["self_ms"] += r["self_ms"]
        k["calls"] += r["calls"]
    for k in by_kind.values():
        k["share"] = k["self_ms"] / kernel_ms if kernel_ms > 0 else None
        k["self_ms"] = round(k["self_ms"], 3)
    return {"iteration_ms": round(iter_ms, 3), "kernel_ms": round(kernel_ms, 3),
            "kernel_calls": sum(r["calls"] for r in kernels),
            "by_kind": by_kind,
            "copies": [{"name": r["name"], "calls": r["calls"], "ms": round(r["self_ms"], 3)}
                       for r in copies],
            "top": [{"name": r["name"], "kind": r["kind"], "calls": r["calls"],
                     "self_ms": round(r["self_ms"], 3), "share": round(r["share"], 4)}
                    for r in kernels[:top]]}


def print_table(title, table):
    print("\n== %s: iteration %.1f ms, GPU kernel time %.1f ms in %d kernel calls" % (
        title, table["iteration_ms"], table["kernel_ms"], table["kernel_calls"]))
    print("%-12s %10s %8s %7s" % ("kind", "self ms", "calls", "share"))
    for kind, k in sorted(table["by_kind"].items(), key=lambda kv: -kv[1]["self_ms"]):
        print("%-12s %10.1f %8d %6.1f%%" % (kind, k["self_ms"], k["calls"], 100 * k["share"]))
    for c in table["copies"]:
        print("%-12s %10.1f %8d   (transfer streams)" % (c["name"][:12], c["ms"], c["calls"]))
    print("%10s %7s %6s  %-11s %s" % ("self ms", "calls", "share", "kind", "kernel"))
    for r in table["top"]:
        print("%10.1f %7d %5.1f%%  %-11s %s" % (r["self_ms"], r["calls"], 100 * r["share"],
                                               r["kind"], r["name"][:110]))
    sys.stdout.flush()


def profile_iteration(run_one, warmup):
    """Runs `warmup` iterations, then one under the profiler; returns (profile, wall ms)."""
    from torch.profiler import ProfilerActivity, profile
    for i in range(warmup):
        t = time.perf_counter()
        loss = run_one()
        log("warm-up %d: %.1f ms, loss %.5f" % (i + 1, (time.perf_counter() - t) * 1e3, loss))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        loss = run_one()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    log("profiled iteration: %.1f ms, loss %.5f" % (wall, loss))
    return prof, wall


def run_ours(hf, ids, args):
    config = RoundPipeRunConfig(num_microbatch=args.microbatches, recompute_grain=args.grain)
    kwargs = {}
    if args.gpu_cap_gib:
        kwargs["gpu_memory_cap"] = int(args.gpu_cap_gib * (1 << 30))
    model = roundpipe.wrap_model_to_roundpipe(hf, model_run_config=config, devices="cuda",
                                              name="native", **kwargs)
    adamw = roundpipe.optim.AdamW(lr=args.lr, weight_decay=0.0)
    try:
        def one():
            loss = model.forward_backward(input_args=(ids,), label=ids, loss_fn="causal_lm")
            model.step(adamw)  # asynchronous, as the benchmarks run it; it launches no kernel
            return float(loss)
        prof, wall = profile_iteration(one, args.warmup)
        extra = {"stage_plan": model.stage_plan()}
    finally:
        model.close()
    return prof, wall, extra


def run_baseline(hf, ids, args):
    model = hf.to(device="cuda", dtype=torch.float32).train()
    ids = ids.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    chunks = ids.chunk(args.microbatches)

    def one():
        total = 0.0
        for mb in chunks:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=mb, labels=mb).loss / len(chunks)
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total
    try:
        prof, wall = profile_iteration(one, args.warmup)
    finally:
        del opt
        model.to("cpu")
    return prof, wall, {"mode": "fp32 weights, bf16 autocast, fused AdamW, no checkpointing"}


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("needs a GPU (torch sees none)")
        return 77
    hf = BUILDER.build_hf(args)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, hf.config.vocab_size, (args.batch, args.seq), generator=g)
    out = {"config": {"layers": args.layers, "batch": args.batch, "seq": args.seq,
                      "microbatches": args.microbatches, "grain": args.grain,
                      "gpu_cap_gib": args.gpu_cap_gib, "tiny": args.tiny,
                      "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "library": roundpipe.library_version()}}
    initial = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    runners = {"ours": run_ours, "baseline": run_baseline}
    for path in args.paths:
        with torch.no_grad():
            hf.load_state_dict(initial)
        prof, wall, extra = runners[path](hf, ids, args)
        table = kernel_table(prof, wall, args.top)
        table.update(extra)
        table["tokens_per_s"] = round(args.batch * args.seq / (wall / 1e3), 1)
        out[path] = table
        print_table(path, table)
        del prof
        gc.collect()
        torch.cuda.empty_cache()
    print(json.dumps({"profile_kernels": out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
