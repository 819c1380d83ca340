#!/usr/bin/env python3
"""Python layers against the native engine on one Qwen3-1.7B-shaped model (issue 13).

    ROUNDPIPE_LIBRARY=build-gpu/libroundpipe.so PYTHONPATH=bindings/python \
        python3 bench/python_layers/qwen3_python_layers_bench.py            # H200: 8 x 4096
    ... --tiny --layers 2 --seq 64 --batch 2 --device cpu                       # CPU smoke run

transformers builds ``Qwen3ForCausalLM`` from a ``Qwen3Config`` with Qwen3-1.7B's shape (hidden
2048, 28 layers, 16 query / 8 key-value heads, head_dim 128, intermediate 6144, vocabulary
151936, tied embeddings, rope_theta 1e6, SDPA attention), random weights, bf16. The same module
is trained two ways in this process, one after the other (each model closed before the next is
built):

* ``python_layers``: ``wrap_model_to_roundpipe(model, native_preset=False)``: the Sequential
  preset of transformers' own modules (embedding + rotary tables, one layer per
  ``Qwen3DecoderLayer``, final norm + LM head), every layer a Python layer
  (``torch.func.functional_call`` over the weights the engine lends, torch autograd), and a
  Python causal-LM loss on the device (cross entropy of the fp32 logits, as upstream's recipes
  write it). The tied embedding becomes two copies, one per adapter (roundpipe/_hf_presets.py):
  310M more parameters streamed and updated than the native model.
* ``native``: ``wrap_model_to_roundpipe(model)``: the engine's own Qwen3 layers (built from the
  config, weights copied) with its fused, chunked causal-LM loss.

Each: ``--warmup`` iterations, then ``--steps`` timed ones; an iteration is
``forward_backward`` over ``--batch`` sequences of ``--seq`` random tokens in ``--microbatches``
microbatches plus an asynchronous built-in AdamW ``step`` (the next iteration overlaps it; the
time a step waits for the previous one counts), as bench/train's train_bench measures the native
engine. tokens/s = batch * seq / mean iteration time (host clock). Peak GPU memory: the
engine's caching-allocator peak (rp_cuda_memory_stats) over the timed iterations, plus torch's
when Python's torch has its own allocator (detected, reported as ``shared_allocator``).

Prints progress on stderr and one JSON object on stdout:
    {"python_layers": {"tokens_per_s", "iter_ms", "peak_gib", "first_loss", ...},
     "native": {...}, "ratio": python_layers / native tokens/s, "config": {...}}
``--paths`` runs only some of the two. Exit status 0 when every path ran and its losses were
finite (the first losses of the two paths should agree within bf16 noise: same weights, same
tokens; reported as ``first_loss_rel_diff``), 1 otherwise.
"""

import argparse
import ctypes
import gc
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402

GIB = float(1 << 30)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def log(msg):
    print("[qwen3_python_layers_bench] %s" % msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed iterations (as run_gpu_bench.sh)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=None,
                   help="default: min(4, --batch) (4: the native engine's best 1.7B figure in "
                        "bench/RESULTS.md, stage grain, default memory cap)")
    p.add_argument("--grain", choices=("stage", "layer"), default="stage",
                   help="recompute_grain of the run configuration")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: every visible GPU (one on the benchmark machine); cpu: "
                        "--cpu-devices CPU worker devices")
    p.add_argument("--cpu-devices", type=int, default=2)
    p.add_argument("--tiny", action="store_true",
                   help="hidden 64, 4 / 2 heads of 16, intermediate 128, vocabulary 512")
    p.add_argument("--paths", default="python_layers,native",
                   help="comma-separated subset of python_layers,native (in that order)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="model dtype (fp32: a check that both paths compute the same loss)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.microbatches is None:
        args.microbatches = min(4, args.batch)
    args.paths = [x for x in args.paths.split(",") if x]
    for x in args.paths:
        if x not in ("python_layers", "native"):
            p.error("unknown path %r" % x)
    return args


def qwen3_config(args):
    from transformers import Qwen3Config
    shape = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936)
    if args.tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)
    return Qwen3Config(num_hidden_layers=args.layers, tie_word_embeddings=True,
                       rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu",
                       max_position_embeddings=max(40960, args.seq), use_sliding_window=False,
                       attention_bias=False, attention_dropout=0.0, initializer_range=0.02,
                       attn_implementation="sdpa", **shape)


def build_hf(args):
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    dtype = DTYPES[args.dtype]
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built and initialised in the model dtype: no fp32 copy
    try:
        model = Qwen3ForCausalLM(qwen3_config(args))
    finally:
        torch.set_default_dtype(default)
    model = model.to(dtype).train()
    log("transformers %s built in %.1f s: %d parameters (%s)" % (
        type(model).__name__, time.perf_counter() - t0,
        sum(p.numel() for p in model.parameters()), model.config._attn_implementation))
    return model


def devices_of(args):
    return "cuda" if args.device == "cuda" else ("cpu", args.cpu_devices)


# -- GPU memory ----------------------------------------------------------------------------------


class GpuMemory:
    """Peak GPU memory of the engine (rp_cuda_memory_stats) and, when Python's torch has an
    allocator of its own, of torch too."""

    def __init__(self, on_gpu):
        self.on_gpu = on_gpu and torch.cuda.is_available()
        self.devices = range(torch.cuda.device_count()) if self.on_gpu else range(0)
        self.shared = None
        if self.on_gpu:
            before = self._engine(0)[0]
            probe = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
            self.shared = self._engine(0)[0] - before >= (64 << 20)
            del probe
            torch.cuda.empty_cache()

    @staticmethod
    def _engine(device):
        from roundpipe._capi import lib
        now, peak = ctypes.c_int64(), ctypes.c_int64()
        lib().rp_cuda_memory_stats(ctypes.byref(now), ctypes.byref(peak), device)
        return now.value, peak.value

    def reset(self):
        from roundpipe._capi import lib
        for d in self.devices:
            lib().rp_cuda_reset_peak_memory(d)
            torch.cuda.reset_peak_memory_stats(d)

    def peak_bytes(self):
        if not self.on_gpu:
            return None
        peak = 0
        for d in self.devices:
            p = self._engine(d)[1]
            if not self.shared:
                p += torch.cuda.max_memory_allocated(d)
            peak = max(peak, p)
        return peak


# -- one path ------------------------------------------------------------------------------------


def causal_lm_loss(n_mb):
    """transformers' labels= loss of one microbatch, over labels already shifted by one (the
    last position -100), so the logits are used as they are: no slice, no copy before the
    fp32 cast; / n_mb: the batch mean over microbatches of equal size."""
    def loss_fn(outputs, shifted):  # outputs: the model's CausalLMOutputWithPast
        return F.cross_entropy(outputs.logits.flatten(0, 1).float(), shifted.flatten(),
                               ignore_index=-100) / n_mb
    return loss_fn


def run_path(path, hf, ids, args, memory):
    n_mb = args.microbatches
    config = RoundPipeRunConfig(num_microbatch=n_mb, recompute_grain=args.grain)
    t0 = time.perf_counter()
    if path == "python_layers":
        model = roundpipe.wrap_model_to_roundpipe(
            hf, native_preset=False, model_run_config=config, devices=devices_of(args),
            name="python_layers")
        shifted = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
        fb = dict(input_args=(ids,), label=shifted, loss_fn=causal_lm_loss(n_mb))
    else:
        model = roundpipe.wrap_model_to_roundpipe(
            hf, model_run_config=config, devices=devices_of(args), name="native")
        fb = dict(input_args=(ids,), label=ids, loss_fn="causal_lm")
    create_s = time.perf_counter() - t0
    n_python = len(model._python_layers)
    log("%s: %r built in %.1f s (%d Python layers)" % (path, model, create_s, n_python))
    result = {"layers": model.num_layers, "python_layers": n_python,
              "stages": model.num_stages, "devices": model.num_devices,
              "params": sum(p.numel() for p in model.optim_parameters()),
              "create_s": round(create_s, 2)}
    adamw = roundpipe.optim.AdamW(lr=args.lr, weight_decay=0.0)
    losses, iter_s = [], []
    try:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                model.synchronize()
                memory.reset()
            t = time.perf_counter()
            loss = model.forward_backward(**fb)
            model.step(adamw)  # async: waits for the previous step, overlaps the next call
            dt = time.perf_counter() - t
            losses.append(float(loss))
            if i >= args.warmup:
                iter_s.append(dt)
            log("%s %s %d: %.1f ms, loss %.5f" % (
                path, "warmup" if i < args.warmup else "step", i + 1 if i < args.warmup
                else i - args.warmup + 1, dt * 1e3, losses[-1]))
        model.synchronize()
        peak = memory.peak_bytes()
        result["stage_plan"] = model.stage_plan()
    finally:
        model.close()
    tokens = args.batch * args.seq
    mean = sum(iter_s) / len(iter_s) if iter_s else float("nan")
    result.update({
        "tokens_per_iter": tokens, "iter_ms": round(mean * 1e3, 3),
        "iter_ms_all": [round(s * 1e3, 1) for s in iter_s],
        "tokens_per_s": round(tokens / mean, 1) if iter_s else None,
        "peak_gib": round(peak / GIB, 3) if peak is not None else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "finite": all(math.isfinite(x) for x in losses)})
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("--device cuda but torch sees no GPU")
        return 2
    if args.steps < 1:
        log("--steps must be at least 1")
        return 2
    memory = GpuMemory(args.device == "cuda")
    hf = build_hf(args)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, hf.config.vocab_size, (args.batch, args.seq), generator=g)
    out = {"bench": "qwen3_python_layers",
           "config": {"shape": "tiny" if args.tiny else "qwen3-1.7b", "layers": args.layers,
                      "batch": args.batch, "seq": args.seq, "microbatches": args.microbatches,
                      "grain": args.grain, "steps": args.steps, "warmup": args.warmup,
                      "device": args.device, "dtype": args.dtype, "optim": "AdamW (built-in), async",
                      "library": roundpipe.library_version(),
                      "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                      "shared_allocator": memory.shared}}
    # synchronize() writes the trained weights back into `hf`: each path starts from these.
    initial = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    ok = True
    for path in args.paths:
        with torch.no_grad():
            hf.load_state_dict(initial)
        try:
            out[path] = run_path(path, hf, ids, args, memory)
            ok = ok and out[path]["finite"]
        except Exception as exc:  # report what failed, still print the JSON
            log("%s failed: %s: %s" % (path, type(exc).__name__, exc))
            out[path] = {"error": "%s: %s" % (type(exc).__name__, exc)}
            ok = False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    py, nat = out.get("python_layers", {}), out.get("native", {})
    if py.get("tokens_per_s") and nat.get("tokens_per_s"):
        out["ratio"] = round(py["tokens_per_s"] / nat["tokens_per_s"], 4)
    if py.get("first_loss") is not None and nat.get("first_loss") is not None:
        out["first_loss_rel_diff"] = abs(py["first_loss"] - nat["first_loss"]) / \
            abs(nat["first_loss"])
    print(json.dumps(out), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
