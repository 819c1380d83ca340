"""Hugging Face causal LMs without a native engine preset train through
wrap_model_to_roundpipe as Python layers of their own transformers modules (issue 13).

A tiny Mixtral (a mixture-of-experts Llama-like decoder: Qwen3-MoE has native layers now) and a
tiny GPT-2 with random weights; the reference is transformers itself on a
deep copy: per microbatch, ``model(input_ids=..., labels=...).loss / num_microbatch`` and
backward, then the same SGD step. Compared: losses of 3 steps, logits, and the weights the
wrapped module holds after synchronize().

GPT-2 is built with tie_word_embeddings=False: the preset's input and output adapters are
separate layers, each holding its own copy of a tied weight (see roundpipe/_hf_presets.py).
Dropout is 0 on both sides (transformers draws its masks from its own generator state).

Tolerance: fp32, relative 1e-5 with an absolute floor of 1e-6, as for the other Python-layer
tests: the same transformers code runs on the same microbatches on both sides.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6
DEVICES = ("cpu", 2)
N_MB = 3
VOCAB = 64


def mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.MixtralForCausalLM(cfg)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  tie_word_embeddings=False)
    return transformers.GPT2LMHeadModel(cfg)


def causal_lm_loss(logits, labels):
    """transformers' labels= loss of one microbatch: token t scored against label t + 1."""
    logits = logits.logits  # the model's CausalLMOutputWithPast
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                             labels[:, 1:].flatten()) / N_MB


@pytest.mark.parametrize("make", [mixtral, gpt2], ids=["mixtral", "gpt2"])
def test_losses_match_transformers(make):
    torch.manual_seed(0)
    hf = make().float()
    ref = copy.deepcopy(hf)
    model = roundpipe.wrap_model_to_roundpipe(hf, devices=DEVICES)
    assert isinstance(model, roundpipe.RoundPipe) and model.num_stages > 1
    assert model.config is hf.config  # attributes forward to the wrapped model
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, VOCAB, (6, 10), generator=g)
        loss = model.forward_backward((ids,), label=ids, loss_fn=causal_lm_loss)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        want = 0.0
        for mb in torch.tensor_split(ids, N_MB):
            mb_loss = ref(input_ids=mb, labels=mb).loss / N_MB
            mb_loss.backward()
            want += float(mb_loss.detach())
        ref_opt.step()
        ref_opt.zero_grad()
        assert float(loss) == pytest.approx(want, rel=RTOL), "step %d" % step
    model.synchronize()
    ids = torch.randint(0, VOCAB, (6, 10), generator=g)
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(input_ids=ids).logits, rtol=RTOL,
                                   atol=ATOL)
    got, want = hf.state_dict(), ref.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))
    model.close()
