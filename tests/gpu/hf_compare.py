#!/usr/bin/env python3
"""RoundPipe's Qwen3, Qwen3-MoE and Llama against Hugging Face transformers.

    python3 tests/gpu/hf_compare.py [--device cuda|cpu] [--devices N]

For tiny Qwen3 and Llama configs (2 layers, hidden 64, 4 query : 2 key-value heads, tied and
untied embeddings, Llama with llama3 rope scaling and attention biases) and a tiny Qwen3-MoE (3
layers, layer 1 dense, 4 experts of width 32, top-2; on GPUs its bf16 experts run as grouped
GEMMs), transformers builds a
model with random weights and saves it with save_pretrained (one file, or small shards); RoundPipe
loads the directory (rp_model_create_from_hf) and both compute, on a right-padded batch:
  * logits of every real token (rp_forward; the attention mask is input 1),
  * the causal-LM loss (RP_LOSS_CAUSAL_LM, 3 microbatches; transformers' `labels=` loss),
  * the gradient of every parameter.
Tolerances (norm-based relative error): fp32 logits and loss 1e-4, gradients 1e-3; bf16 (both
sides in bf16) logits, loss and gradients 2e-2 (a bf16 gradient further off still passes when it
is no further from the fp32 gradient than 1.5x transformers' own bf16 gradient is). The reverse direction: RoundPipe takes an AdamW
step, saves with rp_model_save_hf, transformers loads the directory and its logits must match
RoundPipe's (fp32, 1e-4); a sharded checkpoint is saved back with the same shards.
Qwen3-MoE's routers are drawn with std 0.5 (not 0.02) so that routing is not near-uniform, and
the fp32 comparison first checks that it is well posed: every token's k-th and (k+1)-th router
logits are 1e-4 apart or more, far beyond fp32 rounding, so no top-k choice can differ between
the two implementations. In bf16 a few near-ties do flip (in transformers' own bf16 too); the
tolerances above cover that.
On CUDA, a last check trains a model with vocabulary 151936 on 8192 tokens and asserts that the
peak GPU memory stays below the size of the full logits tensor (the loss is chunked).

Prints one line per check and a closing 'N passed, N failed' line. Exit 0 when every check
passes, 1 otherwise, 77 (skip) when transformers or (for --device cuda) CUDA is missing.
"""

import argparse
import ctypes
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bindings", "python"))

SKIP = 77

try:
    import torch
    import transformers
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
except ImportError as e:  # pragma: no cover - depends on the machine
    print("SKIP: %s" % e)
    sys.exit(SKIP)

from roundpipe import _capi, _dlpack  # noqa: E402

RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append(ok)
    print("%s %s %s" % ("PASS" if ok else "FAIL", name, detail), flush=True)


def rel(a, b):
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    return ((a - b).norm() / max(b.norm().item(), 1e-12)).item()


# ---- RoundPipe through the raw C API ----------------------------------------------------------


class RP:
    """A RoundPipe model handle (raw calls of roundpipe._capi)."""

    def __init__(self, handle, lib):
        self.h = handle
        self.L = lib

    @staticmethod
    def options(lib, dtype, device_kind, num_devices, seed=0):
        opts = _capi.rp_model_options_p()
        lib.rp_model_options_create(ctypes.byref(opts))
        lib.rp_model_options_set_model_dtype(opts, dtype)
        lib.rp_model_options_set_devices(opts, device_kind, num_devices)
        lib.rp_model_options_set_seed(opts, seed)
        return opts

    @classmethod
    def from_hf(cls, path, dtype, device_kind, num_devices):
        L = _capi.lib()
        opts = cls.options(L, dtype, device_kind, num_devices)
        h = _capi.rp_model_p()
        try:
            L.rp_model_create_from_hf(ctypes.byref(h), path.encode(), opts)
        finally:
            L.rp_model_options_destroy(opts)
        return cls(h, L)

    @classmethod
    def from_config(cls, config_json, dtype, device_kind, num_devices):
        L = _capi.lib()
        opts = cls.options(L, dtype, device_kind, num_devices)
        h = _capi.rp_model_p()
        try:
            L.rp_model_create_from_hf_config(ctypes.byref(h), config_json.encode(), opts)
        finally:
            L.rp_model_options_destroy(opts)
        return cls(h, L)

    def close(self):
        if self.h:
            self.L.rp_model_destroy(self.h)
            self.h = None

    def _config(self, num_microbatch):
        cfg = _capi.rp_run_config_p()
        self.L.rp_run_config_create(ctypes.byref(cfg))
        self.L.rp_run_config_set_num_microbatch(cfg, num_microbatch)
        return cfg

    def forward(self, inputs, num_microbatch):
        cfg = self._config(num_microbatch)
        borrowed = _dlpack.BorrowedInputs([t.contiguous().cpu() for t in inputs])
        out = _capi.rp_tensor_list_p()
        try:
            self.L.rp_forward(ctypes.byref(out), self.h, borrowed.array, borrowed.count, cfg)
            ptr = ctypes.c_void_p()
            self.L.rp_tensor_list_get(ctypes.byref(ptr), out, 0)
            return _dlpack.from_owned(ptr.value).clone()
        finally:
            self.L.rp_tensor_list_destroy(out)
            self.L.rp_run_config_destroy(cfg)

    def forward_backward(self, inputs, labels, num_microbatch):
        cfg = self._config(num_microbatch)
        loss = _capi.rp_loss_p()
        self.L.rp_loss_create(ctypes.byref(loss), _capi.RP_LOSS_CAUSAL_LM)
        borrowed = _dlpack.BorrowedInputs([t.contiguous().cpu() for t in inputs])
        lab = _dlpack.BorrowedInputs([labels.contiguous().cpu()])
        value = ctypes.c_double()
        try:
            self.L.rp_forward_backward(ctypes.byref(value), None, self.h, borrowed.array,
                                       borrowed.count, ctypes.c_void_p(lab.pointers[0]), loss, cfg)
        finally:
            self.L.rp_loss_destroy(loss)
            self.L.rp_run_config_destroy(cfg)
        return value.value

    def params(self, grads):
        """{our name: fp32 tensor copy} of the master weights or the gradients."""
        self.L.rp_synchronize(self.h)
        n = ctypes.c_size_t()
        self.L.rp_param_count(ctypes.byref(n), self.h)
        out = {}
        for i in range(n.value):
            name = ctypes.c_char_p()
            self.L.rp_param_name(ctypes.byref(name), self.h, i)
            ptr = ctypes.c_void_p()
            if grads:
                self.L.rp_param_grad(ctypes.byref(ptr), self.h, i)
            else:
                self.L.rp_param_master(ctypes.byref(ptr), self.h, i)
            out[name.value.decode()] = _dlpack.from_owned(ptr.value).clone()
        return out

    def step_adamw(self, lr):
        opt = _capi.rp_optimizer_p()
        self.L.rp_optimizer_create(ctypes.byref(opt), _capi.RP_OPTIMIZER_ADAMW)
        self.L.rp_optimizer_set_learning_rate(opt, lr)
        try:
            self.L.rp_step(self.h, opt, 0)
        finally:
            self.L.rp_optimizer_destroy(opt)

    def save_hf(self, path):
        self.L.rp_model_save_hf(self.h, path.encode())


def hf_name(ours, num_layers):
    """Hugging Face tensor name of RoundPipe parameter `ours` (the layout of roundpipe.h)."""
    layer, local = ours.split(".", 1)
    layer = int(layer)
    if layer == 0:
        return "model.embed_tokens." + local
    if layer <= num_layers:
        return "model.layers.%d.%s" % (layer - 1, local)
    if layer == num_layers + 1:
        return "model.norm." + local
    return "lm_head." + local


# ---- the comparisons --------------------------------------------------------------------------


def tiny_configs():
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    out = []
    for tied in (False, True):
        out.append(("qwen3" + ("-tied" if tied else ""), Qwen3ForCausalLM,
                    Qwen3Config(head_dim=16, tie_word_embeddings=tied, rope_theta=1000000.0,
                                **common)))
        out.append(("llama" + ("-tied" if tied else ""), LlamaForCausalLM,
                    LlamaConfig(tie_word_embeddings=tied, attention_bias=not tied,
                                rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32},
                                **common)))
    out.append(("qwen3-moe", Qwen3MoeForCausalLM,
                 Qwen3MoeConfig(head_dim=16, rope_theta=1000000.0, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                mlp_only_layers=[1], norm_topk_prob=True,
                                **dict(common, num_hidden_layers=3))))
    return out


def widen_routers(model):
    """Routers drawn with std 0.5: tokens prefer experts clearly (initializer_range 0.02 makes
    the router probabilities nearly uniform)."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)


def routing_margin(model, ids, mask):
    """The smallest gap between a token's k-th and (k+1)-th router logit (fp32), over the
    batch's real tokens and the sparse layers."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    k = model.config.num_experts_per_tok
    real = mask.bool().reshape(-1)
    gaps = []
    for logits in out.router_logits:
        top = logits.float()[real].sort(-1, descending=True).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))
    return min(gaps)


def batch(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 24
    ids = torch.randint(0, vocab, (B, T), generator=g)
    lengths = [24, 20, 24, 9, 17, 24]
    mask = torch.zeros(B, T, dtype=torch.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[1, 3:6] = -100  # prompt tokens without a target
    return ids, mask, labels


def compare_family(name, cls, config, args, root):
    device = torch.device(args.device)
    kind = _capi.RP_DEVICE_CUDA if args.device == "cuda" else _capi.RP_DEVICE_CPU
    torch.manual_seed(1234)
    ref = cls(config).eval()
    moe = cls is Qwen3MoeForCausalLM
    if moe:
        widen_routers(ref)
    ckpt = os.path.join(root, name)
    shard = "30KB" if "qwen3" in name else None
    ref.save_pretrained(ckpt, **({"max_shard_size": shard} if shard else {}))
    ids, mask, labels = batch(config.vocab_size, 7)
    real = mask.bool()
    if moe:
        margin = routing_margin(ref, ids, mask)
        check("%s routing well posed" % name, margin > 1e-4, "min top-k logit gap %.2e" % margin)
    L = config.num_hidden_layers
    hf32 = {}  # transformers' fp32 gradients, the truth the bf16 gradients are measured against

    for dtype_name, rp_dtype, tdtype, tol_out, tol_grad in (
            ("fp32", _capi.RP_DTYPE_F32, torch.float32, 1e-4, 1e-3),
            ("bf16", _capi.RP_DTYPE_BF16, torch.bfloat16, 2e-2, 2e-2)):
        if tdtype == torch.bfloat16 and args.device == "cpu" and not args.bf16_on_cpu:
            continue
        model = cls.from_pretrained(ckpt, dtype=tdtype, attn_implementation="sdpa").to(device)
        if moe and hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")  # modeling_qwen3_moe.py's own loop
        model.train()  # no dropout in these configs; train mode as RoundPipe's training call
        rp = RP.from_hf(ckpt, rp_dtype, kind, args.devices)
        try:
            # Logits of every real token.
            with torch.no_grad():
                want = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            got = rp.forward([ids, mask], 2)
            err = rel(got.float()[real], want.float().cpu()[real])
            check("%s %s logits" % (name, dtype_name), err <= tol_out, "rel %.2e" % err)

            # Loss and gradients.
            model.zero_grad()
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                        labels=labels.to(device))
            out.loss.backward()
            loss = rp.forward_backward([ids, mask], labels, 3)
            err = abs(loss - out.loss.item()) / abs(out.loss.item())
            check("%s %s loss" % (name, dtype_name), err <= tol_out,
                  "rp %.6f hf %.6f rel %.2e" % (loss, out.loss.item(), err))
            hf_params = dict(model.named_parameters())
            grads = rp.params(grads=True)
            n_hf = len(hf_params)
            if dtype_name == "fp32":
                worst, worst_name = 0.0, ""
                for ours, g in grads.items():
                    p = hf_params[hf_name(ours, L)]
                    hf32[hf_name(ours, L)] = p.grad.detach().float().cpu()
                    e = rel(g, p.grad.float())
                    if e > worst:
                        worst, worst_name = e, hf_name(ours, L)
                check("%s %s grads" % (name, dtype_name), worst <= tol_grad and len(grads) == n_hf,
                      "%d tensors, worst rel %.2e (%s)" % (len(grads), worst, worst_name))
            else:
                # Both sides carry bf16 rounding noise of about 1e-2 against the fp32 truth.
                # A gradient passes when it is within 2e-2 of transformers' bf16 one, or, failing
                # that, at most 1.5x as far from transformers' fp32 gradient as transformers' own
                # bf16 gradient is.
                worst16, worst_name, bad = 0.0, "", []
                for ours, g in grads.items():
                    hn = hf_name(ours, L)
                    e16 = rel(g, hf_params[hn].grad.float())
                    if e16 > worst16:
                        worst16, worst_name = e16, hn
                    if e16 > tol_grad and hn in hf32:
                        e32 = rel(g, hf32[hn])
                        base = rel(hf_params[hn].grad.float(), hf32[hn])
                        if e32 > max(tol_grad, 1.5 * base):
                            bad.append("%s (%.2e vs fp32, transformers bf16 %.2e)" % (hn, e32, base))
                check("%s %s grads" % (name, dtype_name), not bad and len(grads) == n_hf,
                      "%d tensors, worst rel to transformers bf16 %.2e (%s)%s" % (
                          len(grads), worst16, worst_name, "; " + ", ".join(bad) if bad else ""))

            if dtype_name != "fp32":
                continue
            # Reverse: a RoundPipe step, saved and loaded by transformers.
            rp.step_adamw(1e-2)
            out_dir = os.path.join(root, name + "-rp")
            rp.save_hf(out_dir)
            got = rp.forward([ids, mask], 1)
            back = cls.from_pretrained(out_dir, dtype=torch.float32).to(device).eval()
            with torch.no_grad():
                want = back(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            err = rel(got.float()[real], want.float().cpu()[real])
            moved = rel(got.float()[real], model(input_ids=ids.to(device),
                                                attention_mask=mask.to(device)).logits
                        .detach().float().cpu()[real])
            check("%s saved by RoundPipe, logits in transformers" % name,
                  err <= 1e-4 and moved > 1e-3, "rel %.2e (step moved them by %.2e)" % (err, moved))
            if shard:
                src = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))
                dst = json.load(open(os.path.join(out_dir, "model.safetensors.index.json")))
                check("%s sharded layout kept" % name,
                      src["weight_map"] == dst["weight_map"], "%d shards" % len(
                          set(dst["weight_map"].values())))
        finally:
            rp.close()


def chunked_loss_memory(args):
    """Peak GPU memory of a training call with vocabulary 151936 on 8192 tokens stays below
    the size of the full logits (RoundPipe's own counter of libtorch's caching allocator)."""
    vocab, tokens = 151936, 8192
    cfg = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}
    for dtype_name, rp_dtype, nbytes in (("fp32", _capi.RP_DTYPE_F32, 4),
                                          ("bf16", _capi.RP_DTYPE_BF16, 2)):
        rp = RP.from_config(json.dumps(cfg), rp_dtype, _capi.RP_DEVICE_CUDA, 1)
        try:
            g = torch.Generator().manual_seed(3)
            ids = torch.randint(0, vocab, (2, tokens // 2), generator=g)
            rp.forward_backward([ids], ids, 1)  # warm-up: allocator and kernels
            L = rp.L
            alloc, peak = ctypes.c_int64(), ctypes.c_int64()
            L.rp_synchronize(rp.h)
            L.rp_cuda_memory_stats(ctypes.byref(alloc), ctypes.byref(peak), 0)
            base = alloc.value
            L.rp_cuda_reset_peak_memory(0)
            loss = rp.forward_backward([ids], ids, 1)  # all 8192 tokens in one microbatch
            L.rp_cuda_memory_stats(ctypes.byref(alloc), ctypes.byref(peak), 0)
            peak = peak.value - base
            full = tokens * vocab * nbytes
            check("chunked loss memory %s" % dtype_name,
                  peak < full and math.isfinite(loss) and peak > 0,
                  "peak %.0f MiB above the idle %.0f MiB; full logits %.0f MiB; loss %.3f"
                  % (peak / 2**20, base / 2**20, full / 2**20, loss))
        finally:
            rp.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--devices", type=int, default=1, help="RoundPipe worker devices")
    ap.add_argument("--bf16-on-cpu", action="store_true", help="also run bf16 on the CPU")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return SKIP
    try:
        _capi.lib()
    except Exception as e:  # noqa: BLE001
        print("FAIL: cannot load libroundpipe: %s" % e)
        return 1
    print("transformers %s, torch %s, device %s" % (transformers.__version__, torch.__version__,
                                                   args.device), flush=True)
    if args.device == "cuda":
        # Same math on both sides: no TF32 in fp32 matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory(prefix="rp-hf-") as root:
        for name, cls, config in tiny_configs():
            try:
                compare_family(name, cls, config, args, root)
            except Exception as e:  # noqa: BLE001
                check("%s" % name, False, "raised %s: %s" % (type(e).__name__, e))
    if args.device == "cuda":
        try:
            chunked_loss_memory(args)
        except Exception as e:  # noqa: BLE001
            check("chunked loss memory", False, "raised %s: %s" % (type(e).__name__, e))
    passed = sum(RESULTS)
    failed = len(RESULTS) - passed
    print("%d passed, %d failed" % (passed, failed))
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
