"""PEFT LoRA models through wrap_model_to_roundpipe (issues 14, 18): ``get_peft_model(qwen3,
LoraConfig(...))`` runs on either path, and each test runs on both:
- "native" (the default): the engine's own decoder layers hold the adapters (docs/lora.md);
- "python layers" (``native_preset=False``, and what a PEFT model the engine cannot express
  takes): the Python Sequential preset of its base model, whose modules hold the adapters.
Base weights are frozen parameters (requires_grad=False), adapters are trained; after
``synchronize()`` PEFT's own ``save_pretrained`` writes the trained adapters, and
``PeftModel.from_pretrained`` of them gives the same logits. tests/python/test_lora_native.py
covers the native path's own API (lora=, save_lora, load_lora, merged saves).

Reference: PEFT on a deep copy of the same model, microbatch by microbatch (transformers' loss
of each microbatch, summed, as upstream's forward_backward with labels in input_kwargs), the same
torch.optim step. B of every adapter is random (init_lora_weights=False) so that A has a
gradient from the first step. Tolerance: fp32, relative 1e-5 for logits and losses, 1e-4 for
gradients (absolute floor 1e-6): the same code on the same microbatches.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6
DEVICES = ("cpu", 2)
N_MB = 3
VOCAB = 64


def tiny_lora_qwen3(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False, use_cache=False)
    base = transformers.Qwen3ForCausalLM(cfg).float()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    return base, peft.get_peft_model(copy.deepcopy(base), lora)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (6, 10), generator=g)
    return ids, ids.clone()


# path name -> wrap_model_to_roundpipe's native_preset
PATHS = {"native": True, "python layers": False}


def wrap(model_peft, path):
    model = roundpipe.wrap_model_to_roundpipe(
        model_peft, devices=DEVICES, native_preset=PATHS[path],
        model_run_config=RoundPipeRunConfig(num_microbatch=N_MB))
    # the engine reports adapters only when its own layers hold them
    assert (model.lora is not None) == PATHS[path]
    return model


def reference_step(ref, ids, labels):
    total = 0.0
    for mb_ids, mb_labels in zip(torch.tensor_split(ids, N_MB), torch.tensor_split(labels, N_MB)):
        loss = ref(input_ids=mb_ids, labels=mb_labels).loss
        loss.backward()
        total += float(loss.detach())
    return total


@pytest.mark.parametrize("path", PATHS)
def test_lora_logits_loss_and_adapter_gradients_match_peft(path):
    _, model_peft = tiny_lora_qwen3()
    ref = copy.deepcopy(model_peft)
    ids, labels = batch()
    with wrap(model_peft, path) as model:
        assert isinstance(model, roundpipe.RoundPipe) and model.num_stages > 1
        named = dict(model.optim_named_parameters())
        frozen = [n for n, p in named.items() if not p.requires_grad]
        trained = [n for n, p in named.items() if p.requires_grad]
        assert trained and all("lora_" in n for n in trained)
        assert frozen and not any("lora_" in n for n in frozen)
        model.eval()
        with torch.no_grad():
            want = ref(input_ids=ids, labels=labels)
        out = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.logits, want.logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out.loss, want.loss, rtol=RTOL, atol=ATOL)
        model.train()
        loss = model.forward_backward(input_kwargs={"input_ids": ids, "labels": labels})
        want_loss = reference_step(ref, ids, labels)
        assert float(loss) == pytest.approx(want_loss, rel=RTOL)
        model.synchronize()  # the gradients land on the PEFT model's parameters
        ref_params = dict(ref.named_parameters())
        n_grads = 0
        for name, p in model_peft.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, name
                continue
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-4, atol=ATOL,
                                       msg=lambda m, name=name: "%s: %s" % (name, m))
            assert float(p.grad.abs().sum()) > 0, name
            n_grads += 1
        assert n_grads == sum(p.requires_grad for p in ref.parameters())


@pytest.mark.parametrize("path", PATHS)
def test_training_changes_adapters_only_and_saved_adapters_load_in_peft(path, tmp_path):
    base, model_peft = tiny_lora_qwen3()
    ref = copy.deepcopy(model_peft)
    before = {n: p.detach().clone() for n, p in model_peft.named_parameters()}
    ids, labels = batch()
    with wrap(model_peft, path) as model:
        opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        losses = []
        for _ in range(4):
            losses.append(float(model.forward_backward(
                input_kwargs={"input_ids": ids, "labels": labels})))
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            want = reference_step(ref, ids, labels)
            ref_opt.step()
            ref_opt.zero_grad()
            assert losses[-1] == pytest.approx(want, rel=1e-4)
        assert losses[-1] < losses[0]
        model.synchronize()
        for name, p in model_peft.named_parameters():
            if p.requires_grad:
                assert not torch.equal(p, before[name]), name  # adapters trained
            else:
                assert torch.equal(p, before[name]), name  # base weights bit-identical
        model.eval()
        logits = model(input_ids=ids).logits
        # PEFT's save_pretrained (also reachable as model.save_pretrained) writes the adapters
        model_peft.save_pretrained(str(tmp_path / "direct"))
        model.save_pretrained(str(tmp_path / "through_roundpipe"))
    for where in ("direct", "through_roundpipe"):
        assert (tmp_path / where / "adapter_model.safetensors").exists()
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / where))
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=RTOL,
                                       atol=ATOL)
