"""The first run, from Python: train a small causal language model on real English text for about
a minute and watch it learn (the twin of examples/c/train_tiny_lm.c: same model, data, batches
and seed, so on CPU it prints the same losses).

    PYTHONPATH=bindings/python python3 examples/python/train_tiny_lm.py [--out DIR] [--steps N]
        [--data PATH] [--devices cpu|auto] [--check]

The model is a Llama (the engine's decoder layers) built from a Hugging Face config with a
byte-level vocabulary: tokens 0..255 are the bytes of the text, 256 ends a document, 257 pads
(declared for transformers; training never pads). The text is every licence under
/usr/share/common-licenses, which every Debian machine has. The script prints a greedy sample
before and after training and the loss every 25 steps, saves the model as a Hugging Face
directory (OUT/model), loads it back, writes OUT/losses.csv and OUT/loss.png (matplotlib), and,
when transformers is installed, loads the directory with AutoModelForCausalLM, compares its
logits with ours and generates from it. --check exits with failure unless the loss fell by half
and the plot was drawn; a reloaded model with other logits always fails it.
"""

import argparse
import os
import sys
import time

import torch

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig

from plot_loss import plot_losses  # examples/python/plot_loss.py, next to this file

VOCAB, END_OF_DOC = 258, 256
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "silu",
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 257, "dtype": "float32",
}
BATCH, SEQ, STEPS, PRINT_EVERY, SAMPLE_BYTES = 16, 64, 500, 25, 60
# AdamW with beta2 0.95, as usual for language models; a higher rate stalls longer at the
# byte-frequency plateau (loss ~3).
LEARNING_RATE, BETAS = 5e-4, (0.9, 0.95)
PROMPT = b"You may "


def load_text(path):
    """Every regular file of a folder (symbolic links are aliases there) in name order, or one
    file, as int64 tokens with END_OF_DOC after each file."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path))
        files = [f for f in files if os.path.isfile(f) and not os.path.islink(f)]
    else:
        files = [path]
    tokens = []
    for name in files:
        with open(name, "rb") as f:
            tokens.extend(f.read())
        tokens.append(END_OF_DOC)
    return torch.tensor(tokens, dtype=torch.int64)


def random_starts(count, limit, state):
    """The C example's generator (64-bit LCG, Knuth's MMIX constants), so both train on the
    same windows. Returns (starts, new state)."""
    starts = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        starts.append((state >> 11) % limit)
    return starts, state


def show(ids):
    """Bytes as text: printable ASCII as it is, anything else escaped."""
    out = []
    for c in ids:
        c = int(c)
        if c == 10:
            out.append("\\n")
        elif c in (34, 92):
            out.append("\\" + chr(c))
        elif 32 <= c < 127:
            out.append(chr(c))
        else:
            out.append("\\x%02x" % (c & 0xFF))
    return '"%s"' % "".join(out)


def greedy_sample(model):
    """Append the most likely next byte SAMPLE_BYTES times (or until the end of a document),
    running the whole sequence each time (no KV cache)."""
    ids = list(PROMPT)
    with torch.no_grad():
        while len(ids) < len(PROMPT) + SAMPLE_BYTES:
            logits = model(torch.tensor([ids])).logits  # [1, length, VOCAB]
            best = int(logits[0, -1].argmax())
            if best == END_OF_DOC:
                break
            ids.append(best)
    return ids


def check_with_transformers(directory, ids, logits, ours):
    """Load the saved directory with transformers, compare its logits on `ids` with ours and
    generate from the prompt. Returns the largest logit difference (None without transformers)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers is not installed: skipped loading the directory with it")
        return None
    hf = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        difference = (hf(input_ids=ids).logits - logits).abs().max().item()
        out = hf.generate(torch.tensor([list(PROMPT)]), max_new_tokens=SAMPLE_BYTES,
                          do_sample=False)
    theirs = out[0].tolist()
    if END_OF_DOC in theirs:
        theirs = theirs[:theirs.index(END_OF_DOC)]
    print("transformers %s loads it: max |logit difference| %.3g; greedy sample %s (%s ours)"
          % (type(hf).__name__, difference, show(theirs),
             "the same as" if theirs == ours else "differs from"))
    return difference


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="roundpipe-first-run-py")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--data", default="/usr/share/common-licenses")
    parser.add_argument("--devices", default="auto", choices=("cpu", "auto"),
                        help="cpu: one CPU worker device; auto: every visible GPU, else the CPU")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    text = load_text(args.data)
    print("text: %d bytes from %s" % (len(text), args.data))
    # One microbatch per call: the batch is small, and on CPU splitting it only adds work.
    model = RoundPipe(CONFIG, devices=(args.devices, 1 if args.devices == "cpu" else 0), seed=0,
                      model_run_config=RoundPipeRunConfig(num_microbatch=1))
    print("model: Llama, 2 layers of width 128, %d device(s)" % model.num_devices)
    print("sample before training: %s" % show(greedy_sample(model)))

    adamw = roundpipe.optim.AdamW(lr=LEARNING_RATE, betas=BETAS, weight_decay=0.0)
    losses, state, start = [], 1, time.monotonic()
    with model:
        for step in range(args.steps):
            starts, state = random_starts(BATCH, len(text) - SEQ, state)
            ids = torch.stack([text[s:s + SEQ] for s in starts])
            # A causal LM's labels are its inputs: token t is scored against token t + 1.
            losses.append(float(model.forward_backward((ids,), label=ids)))
            model.step(adamw)  # asynchronous: runs on the optimizer thread during the next step
            if step % PRINT_EVERY == 0 or step == args.steps - 1:
                print("step %4d  loss %.3f  (%.0f s)" % (step, losses[-1],
                                                         time.monotonic() - start), flush=True)
        model.synchronize()
        tail = losses[-10:]
        last = sum(tail) / len(tail)
        print("trained %d steps in %.1f s: loss %.3f at the start, %.3f over the last %d steps "
              "(%.0f%% of the start)" % (args.steps, time.monotonic() - start, losses[0], last,
                                         len(tail), 100 * last / losses[0]))
        ours = greedy_sample(model)
        print("sample after training:  %s" % show(ours))

        directory = os.path.join(args.out, "model")
        model.save_pretrained(directory)  # config.json + model.safetensors, a progress bar
        with RoundPipe(directory, devices=(args.devices, 1 if args.devices == "cpu" else 0),
                       model_run_config=RoundPipeRunConfig(num_microbatch=1)) as reloaded, \
                torch.no_grad():
            logits = model(ids).logits  # a CausalLMOutputWithPast, as transformers'
            difference = (reloaded(ids).logits - logits).abs().max().item()
        print("saved %s; reloaded, max |logit difference| %.3g" % (directory, difference))
    hf_difference = check_with_transformers(directory, ids, logits, ours)

    csv_path, png = os.path.join(args.out, "losses.csv"), os.path.join(args.out, "loss.png")
    with open(csv_path, "w") as f:
        f.write("step,loss\n")
        f.writelines("%d,%.6f\n" % (i, v) for i, v in enumerate(losses))
    try:
        plot_losses(list(range(len(losses))), losses, png, "train_tiny_lm (Python)")
        print("losses: %s, plot: %s" % (csv_path, png))
    except ImportError:
        print("losses: %s; no plot (matplotlib is not installed)" % csv_path)

    failures = []
    if not difference <= 1e-5:
        failures.append("the reloaded model computes different logits")
    # fp32 on both sides, different summation orders: a few ulp of logits of size ~10.
    if hf_difference is not None and not hf_difference <= 1e-4:
        failures.append("transformers computes different logits")
    if args.check and not last <= 0.5 * losses[0]:
        failures.append("the loss did not fall by half")
    if args.check and not os.path.exists(png):
        failures.append("no plot")
    if failures:
        sys.exit("check failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
