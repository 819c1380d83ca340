"""LoRA fine-tuning with RoundPipe from Python: the engine's own decoder layers carry the adapters,
the base model stays frozen (held once, in the model dtype), and the adapters are saved in PEFT's
format (docs/lora.md).

    ROUNDPIPE_LIBRARY=build/libroundpipe.so PYTHONPATH=bindings/python \
        python3 examples/python/finetune_lora.py [--model DIR] [--devices cpu:2] [--steps 60]
        [--rank 16] [--alpha 32] [--lr 2e-3] [--targets all-linear] [--out DIR] [--check]

By default the base model is a tiny, randomly initialised Qwen3 (no download; seconds on a CPU),
saved first as a Hugging Face directory (out/base) so that the adapters have a base to load onto.
--model DIR takes a real one instead (config.json and safetensors weights, e.g. Qwen3-0.6B; its
"dtype" is the model dtype, bf16 for most checkpoints), --devices cuda (or auto) the GPUs.

The task: continue arithmetic progressions of token ids modulo the vocabulary, in a padded batch
whose first 4 tokens are a prompt without targets (as in supervised fine-tuning). With the
defaults the loss falls from ln(128) = 4.87 to about 3.8 in 60 steps, some 10 seconds on 2 CPU
cores (steps 0 and 1 show the same loss: the second forward_backward runs on the weights from
before the first asynchronous step). The adapters
(out/adapter: adapter_config.json, adapter_model.safetensors) are then reloaded into a fresh
model with load_lora, and, with transformers and peft installed, into the base model with
PeftModel.from_pretrained; both must compute the trained model's logits. --check fails (exit 1)
unless the loss fell by a fifth and both reloads agree.
"""

import argparse
import json
import os
import tempfile

import torch

import roundpipe
from roundpipe import LoraConfig, RoundPipe, RoundPipeRunConfig

# The model, the batch and the device syntax of examples/python/finetune_qwen3.py (this folder):
# its tiny Qwen3 (Qwen3-0.6B's shape, shrunk) and its padded batches with prompt tokens masked.
from finetune_qwen3 import CONFIG as TINY_QWEN3  # noqa: E402
from finetune_qwen3 import make_batch, parse_devices  # noqa: E402


def base_directory(args, out):
    """The Hugging Face directory of the base model: --model, or the tiny random Qwen3 (the
    engine's initialisation from the seed) saved into out/base."""
    if args.model:
        return args.model
    directory = os.path.join(out, "base")
    with RoundPipe(TINY_QWEN3, devices=parse_devices(args.devices), seed=1) as base:
        base.save_pretrained(directory)
    return directory


def logits_in_peft(base_dir, adapter_dir, ids, mask):
    """The logits of the base model with the adapters in PEFT, or None without peft."""
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face directory (default: a tiny random Qwen3)")
    parser.add_argument("--devices", default="cpu:2", help='"cpu:2" (default), "cuda", "auto"')
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--targets", default="all-linear",
                        help='"all-linear" or comma-separated names, e.g. "q_proj,v_proj"')
    parser.add_argument("--out", help="keep the base (if generated) and the adapter here")
    parser.add_argument("--check", action="store_true",
                        help="fail unless the loss fell by a fifth and the adapter reloads")
    args = parser.parse_args()

    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout,
                      target_modules=targets)
    devices = parse_devices(args.devices)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        os.makedirs(out, exist_ok=True)
        base_dir = base_directory(args, out)
        model = RoundPipe(base_dir, lora=lora, devices=devices,
                          model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches))
        print("%r, %s; library %s" % (model, model.lora, roundpipe.library_version()))
        state = model.host_state_bytes()
        print("host state: %.1f MB for %d parameters (%.2f bytes each): the frozen base once in "
              "the model dtype, fp32 master, gradient and AdamW moments for the adapters only"
              % (state.bytes / 1e6, state.elements, state.bytes_per_param))
        with open(os.path.join(base_dir, "config.json")) as f:
            config = json.load(f)
        ids, mask, labels = make_batch(config["vocab_size"])

        adamw = roundpipe.optim.AdamW(lr=args.lr, weight_decay=0.0)
        with model:
            losses = []
            for i in range(args.steps):
                loss = model.forward_backward((ids, mask), label=labels)  # causal-LM loss
                model.step(adamw)  # async: the next forward_backward overlaps with it
                losses.append(float(loss))
                print("step %2d  loss %.5f" % (i, losses[-1]))
            adapter_dir = os.path.join(out, "adapter")
            model.save_lora(adapter_dir)  # synchronizes first
            logits = model(ids, mask).logits.float()
        print("saved the adapters: %s (%s)" % (adapter_dir, ", ".join(sorted(os.listdir(
            adapter_dir)))))

        with RoundPipe(base_dir, lora=lora, devices=devices) as fresh:
            fresh.load_lora(adapter_dir)
            again = fresh(ids, mask).logits.float()
        real = mask.bool()  # padding positions are nobody's output
        scale = logits[real].abs().max().item()
        # relative differences: the same weights give the same logits up to fp32 summation
        # order (~1e-6); PEFT computes a bf16 checkpoint in fp32 here, the engine in bf16
        differences = {"load_lora into a fresh model": (again - logits)[real]}
        peft_logits = logits_in_peft(base_dir, adapter_dir, ids, mask)
        if peft_logits is None:
            print("transformers or peft is not installed: skipped PeftModel.from_pretrained")
        else:
            differences["PeftModel.from_pretrained(base, adapter)"] = (peft_logits - logits)[real]
        for what, diff in differences.items():
            differences[what] = diff.abs().max().item() / scale
            print("%s: max |logit difference| / max |logit| %.3g" % (what, differences[what]))

    print("loss %.4f -> %.4f" % (losses[0], losses[-1]))
    if args.check:
        fp32 = (config.get("dtype") or config.get("torch_dtype") or "float32") == "float32"
        tolerance = 1e-5 if fp32 else 5e-2
        problems = [] if losses[-1] < 0.8 * losses[0] else ["the loss did not fall by a fifth"]
        problems += ["%s computes other logits" % what for what, diff in differences.items()
                     if diff > tolerance]
        if problems:
            raise SystemExit("check failed: " + "; ".join(problems))
        print("check passed")
    return losses


if __name__ == "__main__":
    main()
