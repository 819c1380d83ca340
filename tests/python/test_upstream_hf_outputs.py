"""Hugging Face causal LMs behave as their transformers forms (issue 14; upstream's Qwen3
tutorial and API_model): ``forward()`` returns a ``CausalLMOutputWithPast`` with ``.logits``
and, for ``labels=``, ``.loss``; ``return_logits=False`` leaves the logits out; ``labels`` in
``forward_backward``'s ``input_kwargs`` give every microbatch the model's own loss; a Python
``loss_fn`` receives the output object (the tutorial's ``model.loss_function(logits=
outputs.logits, ...)``); custom merges see output objects; ``generate()`` decodes greedily as
transformers' does.

Both paths: the engine's native Qwen3 layers and the Python Sequential preset of transformers'
own modules (``native_preset=False``). The reference is transformers on a deep copy of the same
weights. Tolerance: fp32, relative 1e-5 (absolute floor 1e-6): the native layers compute the
same functions in another order; the Python preset runs the same code.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.causal_lm import CausalLMOutput, causal_lm_loss  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6
DEVICES = ("cpu", 2)
N_MB = 3
VOCAB = 64
PATHS = pytest.mark.parametrize("native", [True, False], ids=["native", "python_preset"])


def tiny_qwen3(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False, use_cache=False, eos_token_id=1, pad_token_id=0)
    return transformers.Qwen3ForCausalLM(cfg).float().eval()


def batch(seed=1, shape=(6, 10)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, shape, generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a few positions without a target
    return ids, labels


def wrapped(hf, native):
    return roundpipe.wrap_model_to_roundpipe(copy.deepcopy(hf), devices=DEVICES,
                                             native_preset=native)


@PATHS
def test_forward_returns_causal_lm_output_with_logits_and_loss(native):
    hf = tiny_qwen3()
    ids, labels = batch()
    with wrapped(hf, native) as model:
        model.eval()
        with torch.no_grad():
            want = hf(input_ids=ids, labels=labels)
        out = model(input_ids=ids)
        assert type(out).__name__ == "CausalLMOutputWithPast" and out.loss is None
        torch.testing.assert_close(out.logits, want.logits, rtol=RTOL, atol=ATOL)
        out = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.logits, want.logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out.loss, want.loss, rtol=RTOL, atol=ATOL)
        # upstream's return_logits=False: the loss only
        out = model(input_ids=ids, labels=labels, return_logits=False)
        assert out.logits is None
        torch.testing.assert_close(out.loss, want.loss, rtol=RTOL, atol=ATOL)
        # transformers' keywords that ask for nothing here are accepted; logits_to_keep too
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                    return_dict=True, logits_to_keep=1)
        torch.testing.assert_close(out.logits, want.logits[:, -1:], rtol=RTOL, atol=ATOL)
        with pytest.raises(roundpipe.RoundPipeUnsupportedError, match="output_attentions"):
            model(input_ids=ids, output_attentions=True)
        # attributes of the transformers model stay reachable (the tutorial's names)
        assert model.vocab_size == VOCAB and model.config is not None


@PATHS
def test_labels_in_input_kwargs_train_with_the_models_own_loss(native):
    hf = tiny_qwen3()
    ref = copy.deepcopy(hf).train()
    ids, labels = batch()
    mine = copy.deepcopy(hf)
    with roundpipe.wrap_model_to_roundpipe(mine, devices=DEVICES, native_preset=native) as model:
        loss = model.forward_backward(input_kwargs={"input_ids": ids, "labels": labels},
                                      run_config=RoundPipeRunConfig(num_microbatch=N_MB))
        model.synchronize()
        # upstream: each microbatch's loss is transformers' loss of that microbatch, summed
        want = 0.0
        for mb_ids, mb_labels in zip(torch.tensor_split(ids, N_MB),
                                     torch.tensor_split(labels, N_MB)):
            mb_loss = ref(input_ids=mb_ids, labels=mb_labels).loss
            mb_loss.backward()
            want += float(mb_loss.detach())
        assert float(loss) == pytest.approx(want, rel=RTOL)
        # synchronize() leaves the gradients on the wrapped transformers module, as upstream
        ref_grads = dict(ref.named_parameters())
        matched = 0
        for name, p in mine.named_parameters():
            if name not in ref_grads or ref_grads[name].grad is None:
                continue
            torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: "%s: %s" % (name, m))
            matched += 1
        assert matched == len(list(ref.parameters()))


@PATHS
def test_python_loss_fn_receives_the_output_object_as_in_the_tutorial(native):
    hf = tiny_qwen3()
    ids, labels = batch()
    with wrapped(hf, native) as model:
        model.eval()
        logits = model(input_ids=ids).logits
        model.train()
        seen = []

        def loss_fn(outputs, labels):  # the Qwen3 tutorial's loss_fn (without the scaler)
            seen.append(type(outputs).__name__)
            return model.loss_function(logits=outputs.logits, labels=labels,
                                       vocab_size=model.vocab_size) / N_MB

        loss, outputs = model.forward_backward(
            input_kwargs={"input_ids": ids}, label=labels, loss_fn=loss_fn,
            return_outputs=True, run_config=RoundPipeRunConfig(num_microbatch=N_MB))
        assert seen == ["CausalLMOutputWithPast"] * N_MB
        want = sum(float(hf(input_ids=i, labels=l).loss) for i, l in
                   zip(torch.tensor_split(ids, N_MB), torch.tensor_split(labels, N_MB))) / N_MB
        assert float(loss) == pytest.approx(want, rel=RTOL)
        assert type(outputs).__name__ == "CausalLMOutputWithPast"
        torch.testing.assert_close(outputs.logits, logits, rtol=RTOL, atol=ATOL)
        # labels in input_kwargs and a loss_fn: outputs.loss is the microbatch's model loss
        loss = model.forward_backward(
            input_kwargs={"input_ids": ids, "labels": labels, "return_logits": False},
            loss_fn=lambda outputs, _: outputs.loss * 2 if outputs.logits is None else None,
            run_config=RoundPipeRunConfig(num_microbatch=N_MB))
        assert float(loss) == pytest.approx(2 * N_MB * want, rel=RTOL)
        # a label without loss_fn: the mean over the batch's targets (the native "causal_lm")
        loss = model.forward_backward((ids,), label=labels)
        assert float(loss) == pytest.approx(float(hf(input_ids=ids, labels=labels).loss),
                                            rel=RTOL)


@PATHS
def test_custom_merge_sees_output_objects(native):
    hf = tiny_qwen3()
    ids, _ = batch()
    with wrapped(hf, native) as model:
        model.eval()
        # upstream's custom_merge example (API_run_config "Writing Custom Merge Functions")
        cfg = RoundPipeRunConfig(num_microbatch=N_MB, merge_output=lambda outputs: torch.cat(
            [out.logits for out in outputs], dim=0))
        merged = model(input_ids=ids, roundpipe_run_config=cfg)
        torch.testing.assert_close(merged, hf(input_ids=ids).logits, rtol=RTOL, atol=ATOL)


@PATHS
def test_generate_greedy_matches_transformers(native):
    hf = tiny_qwen3()
    prompt = torch.tensor([[5, 9, 17, 3]])
    with wrapped(hf, native) as model:
        model.train()
        got = model.generate(prompt, max_new_tokens=6)
        want = hf.generate(prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want), (got, want)
        assert model.training  # generate() runs in eval mode and restores the mode
        # the tutorial's loop: model(...).logits[:, -1, :].argmax()
        ids = prompt
        with torch.no_grad():
            model.eval()
            for _ in range(3):
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                            roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1))
                ids = torch.cat([ids, out.logits[:, -1, :].argmax(dim=-1, keepdim=True)], -1)
        assert torch.equal(ids, want[:, :ids.shape[1]])
        # an end token stops the sequence
        eos = int(want[0, prompt.shape[1]])
        got = model.generate(prompt, max_new_tokens=6, eos_token_id=eos)
        assert torch.equal(got, want[:, :prompt.shape[1] + 1])


def test_a_config_built_causal_lm_gives_output_objects_too():
    hf = tiny_qwen3()
    ids, labels = batch()
    with roundpipe.RoundPipe(hf.config.to_dict(), devices=DEVICES) as model:
        out = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.loss, causal_lm_loss(out.logits, labels),
                                   rtol=RTOL, atol=ATOL)


def test_causal_lm_loss_is_transformers_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, VOCAB, generator=g)
    _, labels = batch(shape=(3, 7))
    torch.testing.assert_close(causal_lm_loss(logits, labels, VOCAB),
                               ForCausalLMLoss(logits, labels, VOCAB))
    torch.testing.assert_close(causal_lm_loss(logits, labels, VOCAB, num_items_in_batch=11),
                               ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=11))


def test_fallback_output_reads_like_transformers():
    logits = torch.zeros(2, 3)
    out = CausalLMOutput(logits=logits)
    assert out.logits is logits and out.loss is None and out[0] is logits
    assert out["logits"] is logits and out.to_tuple() == (logits,)
    out.loss = torch.tensor(1.0)
    assert out[0] is out.loss and len(out.to_tuple()) == 2
