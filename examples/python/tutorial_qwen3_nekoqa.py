"""Upstream's tutorial "Fine-Tune Qwen3-1.7B" (NekoQA), runnable offline.

The code follows upstream's UserGuide_QuickStart_qwen3_nekoqa page as written:
``wrap_model_to_roundpipe(raw_model, model_run_config=RoundPipeRunConfig(num_microbatch=...),
optim_dtype=torch.float32)``, ``roundpipe.optim.Adam`` and ``GradScaler``, the chat template
and padding with -100 labels, the greedy ``generate()`` loop reading ``outputs.logits``,
``forward_backward(input_kwargs=..., label=..., loss_fn=lambda outputs, labels:
scaler.scale(model.loss_function(logits=outputs.logits, ...) / NUM_MICROBATCH))``,
``model.step(optimizer_step)`` then ``scaler.update()``, ``synchronize()`` and
``save_pretrained``. What differs is the data and the size, so that it runs in seconds on CPU
workers without a download:

- the model: a small Qwen3ForCausalLM from a config (random weights), fp32 on CPU workers
  (``--fp16``: float16 as the tutorial; on GPUs float16); a higher learning rate (it learns
  from scratch);
- the tokenizer: a character-level ``PreTrainedTokenizerFast`` built here, with Qwen's special
  tokens and a Qwen-style chat template;
- the dataset: a few dozen made-up catgirl question/answer strings instead of NekoQA-10K.

        python3 examples/python/tutorial_qwen3_nekoqa.py [--devices cpu|cuda|auto]

The script asserts that the epoch loss falls, and that the wrapped model's own
``model.generate()`` decodes as the tutorial's loop does. Without transformers it exits 0
after saying so.
"""

import argparse
import os
import sys
import tempfile

import torch

try:
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
except ImportError:  # the example needs transformers (scripts/setup.sh installs it)
    print("transformers is not installed: skipped")
    sys.exit(0)

import roundpipe
from roundpipe import wrap_model_to_roundpipe, RoundPipeRunConfig, GradScaler
from roundpipe.optim import Adam

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


def made_up_nekoqa():
    """A few dozen catgirl-style question/answer pairs (NekoQA's instruction / output)."""
    things = ["the weather", "breakfast", "my homework", "the weekend", "a walk", "music",
              "the park", "dinner", "a nap", "the rain", "my work", "the garden"]
    questions = ["What do you think about {}?", "Shall we talk about {}?",
                 "Do you like {}?", "Tell me about {}."]
    data = []
    for i, thing in enumerate(things):
        for j, q in enumerate(questions[:3] if i % 2 else questions[1:]):
            answer = "Nya~ master, {} sounds lovely! I will stay by your side, meow~".format(
                thing) if j % 2 == 0 else \
                "Meow! {} makes my tail wag, master. Let us enjoy it together, nya~".format(
                    thing.capitalize())
            data.append({"instruction": q.format(thing), "output": answer})
    return data


def build_tokenizer(texts):
    """A character-level PreTrainedTokenizerFast built offline from `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    chars = sorted(set("".join(texts)) | set(" \n"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
        eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu", help='"cpu" (2 CPU workers), "cuda", "auto"')
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--fp16", action="store_true", help="float16 on CPU workers too")
    args = parser.parse_args(argv)
    on_gpu = args.devices in ("cuda", "auto") and roundpipe.cuda_device_count() > 0
    devices = "cuda" if on_gpu else ("cpu", 2)
    dtype = torch.float16 if on_gpu or args.fp16 else torch.float32
    torch.manual_seed(0)

    # 2. Load the model and tokenizer (made here: a small Qwen3 and a character tokenizer)
    dataset = made_up_nekoqa()
    tokenizer = build_tokenizer([s["instruction"] + s["output"] for s in dataset])
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False, use_cache=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    raw_model = Qwen3ForCausalLM(config).to(dtype)

    # 3. Wrap the model with RoundPipe (the tutorial's code; devices= picks CPU workers here)
    NUM_MICROBATCH = 4  # the tutorial: 10, with batches of 80
    model = wrap_model_to_roundpipe(
        raw_model,
        model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH),
        optim_dtype=torch.float32,
        devices=devices,
    )
    optim = Adam(model.optim_parameters(), lr=args.lr)
    scaler = GradScaler()
    print(model, "dtype", dtype)

    # 4. Prepare the dataset (the tutorial's formatting of each sample)
    text_input = []
    for sample in dataset:
        messages = [
            {"role": "user", "content": sample["instruction"]},
            {"role": "assistant", "content": sample["output"]},
        ]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False
        )
        if len(text) < 2000:  # Filter out overly long samples
            text_input.append(text)
    print(f"Training samples: {len(text_input)}")
    print(f"\nExample:\n{text_input[0][:300]}...")

    BATCH_SIZE = 12  # the tutorial: 80
    dataloader = torch.utils.data.DataLoader(text_input, batch_size=BATCH_SIZE, shuffle=True)

    def tokenize(texts):
        """Tokenize a batch of texts and build labels, with pad positions set to -100."""
        enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=False)
        labels = enc["input_ids"].clone()
        labels[labels == tokenizer.pad_token_id] = -100
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, labels

    # 5. The tutorial's greedy decoder (no KV cache: one whole forward per token)
    @torch.no_grad()
    def generate(prompt, max_new_tokens=args.max_new_tokens):
        model.synchronize()
        model.eval()
        messages = [
            {"role": "user", "content": prompt},
        ]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
        for _ in range(max_new_tokens):
            attention_mask = torch.ones_like(input_ids)
            outputs = model(
                input_ids=input_ids.to(torch.long),
                attention_mask=attention_mask,
                roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1),
            )
            next_id = outputs.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            input_ids = torch.cat([input_ids, next_id], dim=-1)
            if next_id.item() == tokenizer.eos_token_id:
                break
        model.train()
        return tokenizer.decode(input_ids[0], skip_special_tokens=True)

    test_prompts = ["What do you think about the weather?", "Do you like music?"]
    print("===== Before Fine-Tuning =====")
    for p in test_prompts:
        print(f"\nUser: {p}")
        print(f"Model: {generate(p)!r}")

    # 6. Training loop (the tutorial's code)
    def optimizer_step():
        scaler.step(optim)
        optim.zero_grad()

    epoch_losses = []
    for epoch in range(args.epochs):
        model.train()
        epoch_loss = []
        for batch_texts in dataloader:
            input_dict, labels = tokenize(batch_texts)
            loss = model.forward_backward(
                input_kwargs=input_dict,
                label=labels,
                loss_fn=lambda outputs, labels: scaler.scale(
                    model.loss_function(
                        logits=outputs.logits, labels=labels, vocab_size=model.vocab_size
                    )
                    / NUM_MICROBATCH
                ),
            )
            loss_item = loss.item() / scaler.get_scale()
            epoch_loss.append(loss_item)

            model.step(optimizer_step)
            scaler.update()

        mean_loss = sum(epoch_loss) / len(epoch_loss)
        epoch_losses.append(mean_loss)
        print(f"Epoch {epoch + 1}/{args.epochs}, Loss: {mean_loss:.4f}")

    # 7. Output after fine-tuning
    print("===== After Fine-Tuning =====")
    for p in test_prompts:
        print(f"\nUser: {p}")
        print(f"Model: {generate(p)!r}")

    # The wrapped model's own generate() decodes as the tutorial's loop does.
    text = tokenizer.apply_chat_template([{"role": "user", "content": test_prompts[0]}],
                                         tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, return_tensors="pt")["input_ids"]
    ours = model.generate(prompt_ids, max_new_tokens=args.max_new_tokens)
    assert tokenizer.decode(ours[0], skip_special_tokens=True) == generate(test_prompts[0])

    # 8. Save the fine-tuned model
    model.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(os.path.join(tmp, "qwen3-tiny-nekoqa-finetuned"))
        print("\nsaved:", sorted(os.listdir(os.path.join(tmp, "qwen3-tiny-nekoqa-finetuned"))))
    model.close()

    if not epoch_losses[-1] < epoch_losses[0] - 1.0:
        raise SystemExit("the loss did not fall: %s" % epoch_losses)
    print("loss fell: %.4f -> %.4f" % (epoch_losses[0], epoch_losses[-1]))
    return epoch_losses


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
