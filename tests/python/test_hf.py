"""Hugging Face causal LMs (Qwen3ForCausalLM, LlamaForCausalLM) through the binding.

Two groups:
- Without transformers (always run): a tiny Qwen3 built from a config.json written here, through
  RoundPipe(directory) and RoundPipe(config dict); the causal-LM loss is checked against a plain
  torch cross entropy over the model's own logits (docs/semantics.md, "Causal-LM loss"), its
  gradient against a Python loss_fn computing the same thing with torch autograd, training
  lowers it, save_pretrained / RoundPipe(directory) round-trips, and the input and error rules.
- With transformers (skipped when it is not installed; it is not a dependency of the suite):
  tiny Qwen3 and Llama models with random weights are wrapped with wrap_model_to_roundpipe and
  compared with transformers itself: logits, the labels= loss and its gradients, training with
  AdamW, and save_pretrained directories that transformers loads.

Tolerance: fp32, relative 1e-4 as asked, with an absolute floor of 1e-5 for entries near zero
(logits and gradients here are O(0.1..1)). Both sides run the same fp32 operations in the same
order (docs/semantics.md, "Transformer layers"); what differs is summation order inside matrix
products and the chunked loss, a few ulp; measured differences are ~1e-7 relative.
"""

import copy
import json
import os

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import RoundPipeError, RoundPipeRunConfig, RoundPipeUnsupportedError  # noqa: E402

try:
    import transformers  # noqa: F401
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False

needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS,
                                        reason="transformers is not installed")

RTOL = 1e-4
ATOL = 1e-5
DEVICES = ("cpu", 2)
VOCAB = 128

# Qwen3-0.6B's shape, shrunk (as examples/c/finetune_qwen3.c): tied embeddings, per-head q/k
# norms, 4 query heads sharing 2 key-value heads.
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True, "use_sliding_window": False, "attention_bias": False,
    "initializer_range": 0.02, "dtype": "float32",
}


def lm_batch(batch=6, seq=12, vocab=VOCAB, seed=5):
    """Token ids, an attention mask with right padding in some rows, and labels: -100 on
    padding and on the first two (prompt) tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row, length in ((1, seq - 4), (3, seq - 7), (4, seq - 1)):
        mask[row, length:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    return ids, mask, labels


def causal_lm_reference(logits, labels):
    """transformers' labels= loss, from docs/semantics.md: mean over the batch's targets of the
    cross entropy of token t against label t + 1."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).double(), labels[:, 1:].reshape(-1),
        ignore_index=-100)


def write_config(directory, config=QWEN3_CONFIG):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def qwen3_from_config_dir(tmp_path, num_microbatch=3, seed=1):
    directory = write_config(tmp_path / "qwen3")
    with pytest.warns(UserWarning, match="no model.safetensors"):
        return roundpipe.RoundPipe(directory, devices=DEVICES, seed=seed,
                                   model_run_config=RoundPipeRunConfig(
                                       num_microbatch=num_microbatch))


# ---------------------------------------------------------------------------------------------
# Without transformers
# ---------------------------------------------------------------------------------------------


def test_config_directory_builds_a_qwen3_whose_causal_lm_loss_falls_in_training(tmp_path):
    model = qwen3_from_config_dir(tmp_path)
    with model:
        # token_embedding, 2 decoder layers, rms_norm, lm_head (tied: no lm_head weight)
        assert model.num_layers == 5
        names = [n for n, _ in model.optim_named_parameters()]
        assert names[0] == "0.weight" and "1.self_attn.q_norm.weight" in names
        assert not any(n.startswith("4.") for n in names)
        ids, mask, labels = lm_batch()
        opt = roundpipe.optim.AdamW(lr=3e-3, weight_decay=0.0)
        losses = []
        for _ in range(8):
            losses.append(float(model.forward_backward((ids, mask), label=labels,
                                                       loss_fn="causal_lm")))
            model.step(opt)
        model.synchronize()
        # Weights drawn from normal(0, 0.02): logits near 0, so the first loss is ~ln(vocab).
        assert abs(losses[0] - torch.log(torch.tensor(float(VOCAB))).item()) < 0.05
        assert losses[-1] < losses[0] - 0.5, losses
        assert all(b < a for a, b in zip(losses[1:], losses[2:])), losses


def test_causal_lm_loss_is_the_batch_mean_token_cross_entropy_of_the_logits(tmp_path):
    model = qwen3_from_config_dir(tmp_path)
    with model:
        ids, mask, labels = lm_batch()
        logits = model(ids, mask).logits
        assert logits.shape == (6, 12, VOCAB) and logits.dtype == torch.float32
        want = causal_lm_reference(logits, labels)
        for n in (1, 3, 6):  # the mean over the whole batch, whatever the microbatches
            got = model.forward_backward((ids, mask), label=labels, loss_fn="causal_lm",
                                         run_config=RoundPipeRunConfig(num_microbatch=n))
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
            model.zero_grad()
        # Without a loss_fn, a causal LM given labels trains with the causal-LM loss.
        torch.testing.assert_close(model.forward_backward((ids, mask), label=labels), want,
                                   rtol=RTOL, atol=0)
        # The fused loss never forms the logits, so there are no outputs to return.
        with pytest.raises(RoundPipeUnsupportedError, match="forward\\(\\) for logits"):
            model.forward_backward((ids, mask), label=labels, return_outputs=True)
        # A Python loss_fn receives the output object; return_outputs gives it back merged.
        _, outputs = model.forward_backward((ids, mask), label=labels, return_outputs=True,
                                            loss_fn=lambda out, y: out.logits.sum() * 0)
        torch.testing.assert_close(outputs.logits, logits, rtol=RTOL, atol=ATOL)


def test_causal_lm_gradients_equal_a_python_loss_fn_through_autograd(tmp_path):
    model = qwen3_from_config_dir(tmp_path)
    with model:
        ids, mask, labels = lm_batch()
        targets = int((labels[:, 1:] != -100).sum())

        def loss_fn(out, labels_m):  # one microbatch: its summed token losses / all targets
            logits = out.logits
            return torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels_m[:, 1:].reshape(-1),
                ignore_index=-100, reduction="sum") / targets

        builtin = model.forward_backward((ids, mask), label=labels, loss_fn="causal_lm")
        model.synchronize()
        want = {n: p.grad.clone() for n, p in model.optim_named_parameters()}
        model.zero_grad()
        python = model.forward_backward((ids, mask), label=labels, loss_fn=loss_fn)
        model.synchronize()
        torch.testing.assert_close(python, builtin, rtol=RTOL, atol=0)
        for name, p in model.optim_named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=RTOL, atol=1e-7,
                                       msg=lambda m, name=name: "%s: %s" % (name, m))


def test_config_dict_and_config_directory_build_the_same_model(tmp_path):
    ids, mask, _ = lm_batch()
    with qwen3_from_config_dir(tmp_path, seed=3) as a, \
            roundpipe.RoundPipe(QWEN3_CONFIG, devices=DEVICES, seed=3) as b, \
            roundpipe.RoundPipe(json.dumps(QWEN3_CONFIG), devices=DEVICES, seed=3) as c:
        want = a(ids, mask).logits
        assert torch.equal(b(ids, mask).logits, want) and torch.equal(c(ids, mask).logits, want)


def test_model_dtype_follows_the_config_dtype_as_from_pretrained_does():
    ids, mask, _ = lm_batch()
    for config, want in ((dict(QWEN3_CONFIG, dtype="bfloat16"), torch.bfloat16),
                         (dict(QWEN3_CONFIG, dtype=None, torch_dtype="float16"), torch.float16),
                         (dict(QWEN3_CONFIG, dtype=None), torch.float32)):
        with roundpipe.RoundPipe(config, devices=DEVICES) as model:
            assert model(ids, mask).logits.dtype == want
    with roundpipe.RoundPipe(dict(QWEN3_CONFIG, dtype="bfloat16"), devices=DEVICES,
                             model_dtype=torch.float32) as model:
        assert model(ids, mask).logits.dtype == torch.float32


def test_save_pretrained_then_roundpipe_directory_gives_the_same_logits(tmp_path):
    model = qwen3_from_config_dir(tmp_path)
    ids, mask, labels = lm_batch()
    out = tmp_path / "saved"
    with model:
        opt = roundpipe.optim.AdamW(lr=3e-3)
        for _ in range(3):
            model.forward_backward((ids, mask), label=labels)
            model.step(opt)
        model.save_pretrained(str(out))  # synchronizes first
        want = model(ids, mask).logits
        state = model.state_dict()
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "float32"
    assert config["vocab_size"] == VOCAB and config["tie_word_embeddings"] is True
    with roundpipe.RoundPipe(str(out), devices=DEVICES) as reloaded:
        assert torch.equal(reloaded(ids, mask).logits, want)
        got = reloaded.state_dict()
        assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in state)
    # load_pretrained puts the saved weights into a freshly initialised model of that config
    with roundpipe.RoundPipe(QWEN3_CONFIG, devices=DEVICES, seed=9) as other:
        assert not torch.equal(other(ids, mask).logits, want)
        other.load_pretrained(str(out))
        assert torch.equal(other(ids, mask).logits, want)


def test_causal_lm_inputs_by_position_or_keyword_and_position_ids(tmp_path):
    model = qwen3_from_config_dir(tmp_path)
    with model:
        ids, mask, _ = lm_batch()
        want = model(ids, mask).logits
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)
        assert torch.equal(model(ids, attention_mask=mask).logits, want)
        assert torch.equal(model(ids, mask.bool()).logits, want)
        no_mask = model(ids).logits
        assert torch.equal(model(ids, None).logits, no_mask)
        # Position ids 0..seq-1 are the default; given alone they come with an all-ones mask.
        positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
        torch.testing.assert_close(model(ids, position_ids=positions).logits, no_mask,
                                   rtol=RTOL, atol=ATOL)
        # Shifted positions change the logits (RoPE sees them).
        assert not torch.allclose(model(ids, position_ids=positions + 5).logits, no_mask)
        # [1, seq] positions replicated to every microbatch, through a split spec by keyword.
        cfg = RoundPipeRunConfig(split_input=(None, {"position_ids": roundpipe.REPLICATE}))
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=mask, position_ids=positions[:1],
                  roundpipe_run_config=cfg).logits, want, rtol=RTOL, atol=ATOL)
        # labels= gives transformers' loss of the batch (tests/python/test_upstream_hf_outputs.py)
        assert model(input_ids=ids, labels=ids).loss.dim() == 0
        with pytest.raises(RoundPipeUnsupportedError, match="token_type_ids"):
            model(input_ids=ids, token_type_ids=ids)
        with pytest.raises(TypeError, match="both positionally and by keyword"):
            model(ids, input_ids=ids)


def test_unsupported_hugging_face_inputs_name_what_is_supported(tmp_path):
    mistral = dict(QWEN3_CONFIG, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(RoundPipeError) as info:
        roundpipe.RoundPipe(mistral, devices=DEVICES)
    assert "MistralForCausalLM" in info.value.message
    assert "Qwen3ForCausalLM" in info.value.message and "LlamaForCausalLM" in info.value.message
    with pytest.raises(RoundPipeError, match="hidden_act"):
        roundpipe.RoundPipe(dict(QWEN3_CONFIG, hidden_act="gelu"), devices=DEVICES)
    # Weights in a format the engine cannot read are refused, not silently replaced by random
    # ones.
    directory = write_config(tmp_path / "bin")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(RoundPipeUnsupportedError, match="safetensors"):
        roundpipe.RoundPipe(directory, devices=DEVICES)
    # A broken checkpoint is the engine's I/O error, naming the file.
    directory = write_config(tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RoundPipeError) as info:
        roundpipe.RoundPipe(directory, devices=DEVICES)
    assert info.value.status == roundpipe.Status.IO and "model.safetensors" in info.value.message
    # A config without architectures needs a model_type the engine knows.
    with pytest.raises(RoundPipeUnsupportedError, match="model_type"):
        roundpipe.RoundPipe({"model_type": "gpt2", "vocab_size": 8}, devices=DEVICES)
    with pytest.raises(RoundPipeUnsupportedError):
        roundpipe.spec_json(QWEN3_CONFIG)

    class Qwen3ForCausalLM(torch.nn.Module):  # a stand-in without a transformers config
        pass

    for make in (lambda: roundpipe.wrap_model_to_roundpipe(Qwen3ForCausalLM()),
                 lambda: roundpipe.RoundPipe(Qwen3ForCausalLM())):
        with pytest.raises(RoundPipeUnsupportedError) as info:
            make()
        assert "transformers config" in info.value.message
    # Any other module, a stand-in of a Hugging Face class inside a Sequential included, runs as
    # a Python layer (test_python_layers.py).
    # Hugging Face saving needs a Hugging Face model.
    with roundpipe.RoundPipe([{"type": "linear", "in": 2, "out": 2}], devices=DEVICES) as mlp:
        with pytest.raises(RoundPipeError) as info:
            mlp.save_pretrained(str(tmp_path / "mlp"))
        assert info.value.status == roundpipe.Status.STATE and "save(path)" in info.value.message


def test_original_model_attributes_are_read_written_and_deleted_through_the_wrapper():
    class Original:
        vocab_size = 11

    original = Original()
    with roundpipe.RoundPipe([{"type": "linear", "in": 2, "out": 2}], devices=DEVICES) as m:
        with pytest.raises(AttributeError):
            m.vocab_size
        m.set_original_model(original)
        assert m.vocab_size == 11
        m.note = "x"  # not an attribute of RoundPipe: goes to the original model
        assert original.note == "x" and "note" not in vars(m)
        del m.note
        assert not hasattr(original, "note")
        m.eval()  # RoundPipe's own attributes stay its own
        assert m.training is False and not hasattr(original, "training")


def test_finetune_qwen3_example_runs_and_its_loss_falls(tmp_path):
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "examples", "python", "finetune_qwen3.py")
    env = dict(os.environ, ROUNDPIPE_LIBRARY=roundpipe.library_path(), PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.abspath(roundpipe.__path__[0]))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    result = subprocess.run([sys.executable, script, "--steps", "6", "--save",
                             str(tmp_path / "tiny")], env=env, capture_output=True, text=True,
                            timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, result.stdout
    assert "reloaded: max |logit difference| 0" in result.stdout
    assert sorted(os.listdir(tmp_path / "tiny")) == ["config.json", "model.safetensors"]


# ---------------------------------------------------------------------------------------------
# With transformers: wrap_model_to_roundpipe against transformers itself
# ---------------------------------------------------------------------------------------------


def tiny_hf_model(family, seed=0, tied=False):
    """A transformers Qwen3 / Llama with 2 layers, hidden 64, 4 query : 2 key-value heads,
    random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, rope_theta=1e6, **sizes))
    else:
        model = LlamaForCausalLM(LlamaConfig(rope_theta=5e5, **sizes))
    return model.eval()


FAMILIES = [("qwen3", True), ("qwen3", False), ("llama", False)]


def wrap(hf_model, num_microbatch=3):
    return roundpipe.wrap_model_to_roundpipe(
        hf_model, devices=DEVICES, model_run_config=RoundPipeRunConfig(
            num_microbatch=num_microbatch))


def assert_logits_equal_transformers(model, hf, ids, mask):
    """The wrapped model's logits are transformers' for ids alone, with the padding mask (real
    queries; padding queries may differ, docs/semantics.md) and with shifted position ids."""
    torch.testing.assert_close(model(input_ids=ids).logits, hf(input_ids=ids).logits,
                               rtol=RTOL, atol=ATOL)
    got = model(input_ids=ids, attention_mask=mask).logits
    want = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=RTOL, atol=ATOL)
    positions = (torch.arange(ids.shape[1]) + 3).expand_as(ids).contiguous()
    torch.testing.assert_close(model(ids, position_ids=positions).logits,
                               hf(input_ids=ids, position_ids=positions).logits,
                               rtol=RTOL, atol=ATOL)


def torch_adamw_losses(hf, ids, mask, labels, steps, **settings):
    """The reference of the engine's AdamW: `steps` steps of torch.optim.AdamW(**settings) on
    `hf`'s trainable parameters over transformers' labels= loss; the losses, in order."""
    torch_opt = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], **settings)
    losses = []
    for _ in range(steps):
        loss = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@needs_transformers
@pytest.mark.parametrize("family,tied", FAMILIES)
def test_wrapped_transformers_model_computes_transformers_logits(family, tied):
    hf = tiny_hf_model(family, tied=tied)
    ids, mask, _ = lm_batch()
    with wrap(hf) as model, torch.no_grad():
        assert model.config is hf.config  # forwarded to the original model
        assert_logits_equal_transformers(model, hf, ids, mask)


@needs_transformers
@pytest.mark.parametrize("family,tied", FAMILIES)
def test_causal_lm_loss_and_gradients_equal_transformers_labels_loss(family, tied):
    hf = tiny_hf_model(family, tied=tied)
    ids, mask, labels = lm_batch()
    out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    # synchronize() writes the engine's gradients into the wrapped module's .grad: transformers'
    # own are kept aside first.
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    with wrap(hf) as model:
        loss = model.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask},
                                      label=labels, loss_fn="causal_lm")
        torch.testing.assert_close(loss, out.loss.detach().double(), rtol=RTOL, atol=0)
        model.synchronize()
        for name, p in model.optim_named_parameters():
            want = hf_grads[model.hf_parameter_name(name)]
            torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL * want.abs().max(),
                                       msg=lambda m, name=name: "%s: %s" % (name, m))


@needs_transformers
@pytest.mark.parametrize("family,tied", FAMILIES)
def test_training_steps_lower_the_loss_as_transformers_with_adamw_does(family, tied):
    hf = tiny_hf_model(family, tied=tied)
    initial = copy.deepcopy(hf)
    ids, mask, labels = lm_batch()
    with wrap(hf) as model:
        ours = []
        opt = roundpipe.optim.AdamW(lr=1e-2, weight_decay=0.0)
        for _ in range(5):
            ours.append(float(model.forward_backward((ids, mask), label=labels)))
            model.step(opt, is_async=False)
        # The same steps in transformers with torch.optim.AdamW (the wrapper copied the weights,
        # so hf still holds the initial ones).
        theirs = torch_adamw_losses(hf, ids, mask, labels, 5, lr=1e-2, weight_decay=0.0)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=RTOL, atol=0)
        assert ours[-1] < ours[0] - 0.5, ours
        # copy_to_module puts the trained weights back into the transformers model.
        model.synchronize()
        trained = model(ids).logits
        fresh = tiny_hf_model(family, seed=1, tied=tied)
        model.copy_to_module(fresh)
        with torch.no_grad():
            torch.testing.assert_close(fresh(input_ids=ids).logits, trained, rtol=RTOL,
                                       atol=ATOL)


@needs_transformers
@pytest.mark.parametrize("family,tied", FAMILIES)
def test_save_pretrained_loads_in_transformers_with_equal_logits(family, tied, tmp_path):
    from transformers import AutoModelForCausalLM
    hf = tiny_hf_model(family, tied=tied)
    initial = copy.deepcopy(hf)
    ids, mask, labels = lm_batch()
    with wrap(hf) as model:
        opt = roundpipe.optim.AdamW(lr=1e-2)
        for _ in range(3):
            model.forward_backward((ids, mask), label=labels)
            model.step(opt)  # async
        model.save_pretrained(str(tmp_path / "out"))
        model.synchronize()
        want = model(ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(loaded) is type(hf) and loaded.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=RTOL, atol=ATOL)
        assert not torch.allclose(initial(input_ids=ids).logits, want)  # it did train
        # synchronize() left the trained weights in the module that was wrapped
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=RTOL, atol=ATOL)
    # And transformers' own save_pretrained directory loads through RoundPipe(directory).
    hf.save_pretrained(str(tmp_path / "theirs"))
    with roundpipe.RoundPipe(str(tmp_path / "theirs"), devices=DEVICES) as model, \
            torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(input_ids=ids).logits, rtol=RTOL, atol=ATOL)


@needs_transformers
def test_sharded_transformers_checkpoint_loads_and_saves_in_the_same_layout(tmp_path):
    from transformers import AutoModelForCausalLM
    hf = tiny_hf_model("llama")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    shards = sorted(f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids, mask, labels = lm_batch()
    with roundpipe.RoundPipe(str(tmp_path / "sharded"), devices=DEVICES) as model:
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, hf(input_ids=ids).logits, rtol=RTOL,
                                       atol=ATOL)
        model.forward_backward((ids, mask), label=labels)
        model.step(roundpipe.optim.AdamW(lr=1e-2), is_async=False)
        model.save_pretrained(str(tmp_path / "out"))
        want = model(ids).logits
    saved = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors"))
    assert saved == shards and (tmp_path / "out" / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=RTOL, atol=ATOL)


@needs_transformers
def test_bfloat16_transformers_model_is_wrapped_in_bfloat16():
    hf = tiny_hf_model("qwen3").to(torch.bfloat16)
    ids, _, labels = lm_batch()
    with wrap(hf) as model, torch.no_grad():
        got = model(ids).logits
        assert got.dtype == torch.bfloat16
        want = hf(input_ids=ids).logits
        # bf16 has 8 bits of mantissa: compare at its resolution (2^-8 relative).
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
        # The master weights are fp32 copies of the bf16 weights, exactly.
        hf_params = dict(hf.named_parameters())
        for name, p in model.optim_named_parameters():
            assert p.dtype == torch.float32
            assert torch.equal(p, hf_params[model.hf_parameter_name(name)].float())


@needs_transformers
def test_bfloat16_tied_embedding_gradient_is_the_sum_of_both_uses():
    """A tied bf16 embedding gets two contributions in one call on two stages: the LM head's from
    the tail, lent where its download landed, then the embedding's from the first stage's
    backward, which the gradient thread adds to it in the fp32 buffer. The reference: transformers in fp32 on the same (bf16-rounded) weights, untied, so
    that each use's gradient is known; the tied gradient is their sum. The engine computes in
    bf16 (8 significant bits): its gradients were seen within 1% of fp32 ones (test_equivalence.c
    has 9e-3 through 7 layers), so 3e-2 of the norm; each use alone is checked to be well above
    that, so a sum that left either out fails."""
    hf = tiny_hf_model("qwen3", tied=True).to(torch.bfloat16)
    reference = tiny_hf_model("qwen3", tied=False)
    weights = {k: v.float() for k, v in hf.state_dict().items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    reference.load_state_dict(weights)
    ids, mask, labels = lm_batch()
    reference(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    head = reference.lm_head.weight.grad
    embedding = reference.model.embed_tokens.weight.grad
    want = head + embedding
    tolerance = 3e-2
    for part in (head, embedding):
        assert part.norm() > 5 * tolerance * want.norm()
    with wrap(hf) as model:
        model.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask},
                               label=labels, loss_fn="causal_lm")
        model.synchronize()
        grads = {model.hf_parameter_name(n): p.grad for n, p in model.optim_named_parameters()}
    got = grads["model.embed_tokens.weight"]
    assert got.dtype == torch.float32
    assert (got - want).norm() <= tolerance * want.norm(), float((got - want).norm() / want.norm())


@needs_transformers
def test_wrapped_model_with_tensors_the_engine_has_no_place_for_is_refused():
    hf = tiny_hf_model("llama")
    hf.model.extra = torch.nn.Linear(2, 2)  # e.g. an adapter the engine has no place for
    with pytest.raises(RoundPipeUnsupportedError, match="model.extra.weight"):
        wrap(hf)
    hf = tiny_hf_model("qwen3")
    # without the preset, upstream's recursion: the decoder layers become RoundPipes inside
    # the model, whose own forward runs in Python (AutoRoundPipe: no fused forward_backward)
    with roundpipe.wrap_model_to_roundpipe(hf, use_sequential_preset=False,
                                           devices=DEVICES) as auto:
        assert isinstance(auto, roundpipe.AutoRoundPipe)
