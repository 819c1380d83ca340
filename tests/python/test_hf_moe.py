"""Qwen3MoeForCausalLM on the engine's native layers (moe_decoder_layer), against transformers.

A tiny Qwen3-MoE with random weights: 3 decoder layers of which layer 1 is dense
(mlp_only_layers), 4 experts, top-2, hidden 32, expert width 16; a variant where
decoder_sparse_step picks the sparse layers. The reference is transformers' own
Qwen3MoeForCausalLM with its eager experts (the per-expert loop of modeling_qwen3_moe.py), on a
deep copy taken before wrapping (wrapping and synchronize() write the engine's weights and
gradients into the wrapped module). Compared: logits with and without padding and with position
ids; the labels= loss and the gradient of every parameter (attention, router, stacked experts,
dense MLP, norms, embeddings, head) over 3 microbatches; 5 AdamW steps against torch.optim.AdamW;
directories written by save_pretrained on either side and read by the other, single-file and
sharded. Configs with unsupported values are refused with the key named, before anything is
allocated.

The routers are drawn wider than initializer_range (std 0.5 instead of 0.02), so that tokens
prefer experts clearly, and routing_margin checks that the comparison is well posed: every
token's k-th and (k+1)-th router logits are at least 1e-4 apart, a thousand times the difference
fp32 rounding makes between the two implementations' logits (~1e-7), so no top-k choice can
differ between them.

Tolerance: fp32, as in test_hf.py (relative 1e-4, absolute 1e-5 or 1e-5 of the tensor's largest
value for gradients): both sides run the same fp32 operations; what differs is summation order
(GEMM blocking, the sum over a token's experts: transformers adds them expert by expert, the
engine over the slots), a few ulps.
"""

import copy
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe import RoundPipeError  # noqa: E402

from test_hf import (ATOL, DEVICES, RTOL, VOCAB, assert_logits_equal_transformers,  # noqa: E402
                     lm_batch, torch_adamw_losses, wrap)

SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
             norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
             tie_word_embeddings=False)

VARIANTS = {
    "mlp_only_layers": {},
    "unnormalised_top_k": {"norm_topk_prob": False},
    "sparse_step_tied": {"mlp_only_layers": [], "decoder_sparse_step": 2,
                         "tie_word_embeddings": True},
}


def tiny_moe(variant="mlp_only_layers", seed=0):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**dict(SIZES, **VARIANTS[variant]))
    model = transformers.Qwen3MoeForCausalLM(config)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model.eval()


def sparse_layers(hf):
    return [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]


def routing_margin(hf, ids, mask=None):
    """The smallest gap between a token's k-th and (k+1)-th router logit, over the tokens of
    the batch and the sparse layers (top-k of the probabilities is top-k of the logits)."""
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    gaps = []
    for logits in out.router_logits:
        top = logits.float().sort(-1, descending=True).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))
    return min(gaps)


def config_dict(**changes):
    d = json.loads(transformers.Qwen3MoeConfig(**SIZES).to_json_string(use_diff=False))
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    d.update(changes)
    return d


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_moe_layers_compute_transformers_logits(variant):
    hf = tiny_moe(variant)
    ref = copy.deepcopy(hf)
    ids, mask, _ = lm_batch()
    assert routing_margin(ref, ids) > 1e-4 and routing_margin(ref, ids, mask) > 1e-4
    with wrap(hf) as model, torch.no_grad():
        # The engine's own layers, not the Python preset of transformers' modules.
        names = [n for n, _ in model.optim_named_parameters()]
        sparse = sparse_layers(ref)
        assert len(sparse) == (1 if variant == "sparse_step_tied" else 2)
        for i in range(3):
            assert ("%d.mlp.experts.gate_up_proj" % (i + 1) in names) == (i in sparse)
            assert ("%d.mlp.gate_proj.weight" % (i + 1) in names) == (i not in sparse)
        assert_logits_equal_transformers(model, ref, ids, mask)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loss_and_every_gradient_equal_transformers(variant):
    hf = tiny_moe(variant)
    ref = copy.deepcopy(hf)
    ids, mask, labels = lm_batch()
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    want_grads = {n: p.grad for n, p in ref.named_parameters()}
    with wrap(hf) as model:
        loss = model.forward_backward((ids, mask), label=labels)
        torch.testing.assert_close(loss, out.loss.detach().double(), rtol=RTOL, atol=0)
        model.synchronize()
        seen = set()
        for name, p in model.optim_named_parameters():
            hf_name = model.hf_parameter_name(name)
            want = want_grads[hf_name]
            torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL * want.abs().max(),
                                       msg=lambda m, name=hf_name: "%s: %s" % (name, m))
            seen.add(hf_name)
        # Every parameter of transformers' model has its engine twin, router and experts too.
        assert seen == set(want_grads)
        assert any(n.endswith("mlp.gate.weight") for n in seen)
        assert any(n.endswith("mlp.experts.down_proj") for n in seen)


def test_adamw_steps_equal_torch_adamw_on_transformers():
    hf = tiny_moe()
    ref = copy.deepcopy(hf)
    ids, mask, labels = lm_batch()
    with wrap(hf) as model:
        ours = []
        opt = roundpipe.optim.AdamW(lr=1e-2, weight_decay=0.01)
        for _ in range(5):
            ours.append(float(model.forward_backward((ids, mask), label=labels)))
            model.step(opt, is_async=False)
        model.synchronize()
        trained = {model.hf_parameter_name(n): p.detach().clone()
                   for n, p in model.optim_named_parameters()}
    theirs = torch_adamw_losses(ref, ids, mask, labels, 5, lr=1e-2, weight_decay=0.01)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=RTOL, atol=0)
    assert ours[-1] < ours[0] - 0.5, ours
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))


def safetensors_names(directory):
    from safetensors import safe_open
    names = set()
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(directory, f), "pt") as st:
                names.update(st.keys())
    return names


def test_save_pretrained_round_trips_with_transformers(tmp_path):
    hf = tiny_moe()
    ref = copy.deepcopy(hf)
    ids, mask, labels = lm_batch()
    with wrap(hf) as model:
        opt = roundpipe.optim.AdamW(lr=1e-2)
        for _ in range(2):
            model.forward_backward((ids, mask), label=labels)
            model.step(opt)
        model.save_pretrained(str(tmp_path / "ours"))
        model.synchronize()
        want = model(ids).logits
    # On disk one tensor per expert and projection, as Qwen3-MoE checkpoints hold them.
    names = safetensors_names(tmp_path / "ours")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert "model.layers.2.mlp.gate.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    assert len([n for n in names if ".experts." in n]) == 2 * 4 * 3
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), output_loading_info=True)
    assert type(loaded) is transformers.Qwen3MoeForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, want, rtol=RTOL,
                                   atol=ATOL)
        assert not torch.allclose(ref(input_ids=ids).logits, want)  # it did train
    # transformers' own save_pretrained, read by the engine: the same logits.
    ref.save_pretrained(str(tmp_path / "theirs"))
    with roundpipe.RoundPipe(str(tmp_path / "theirs"), devices=DEVICES) as model, \
            torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(input_ids=ids).logits, rtol=RTOL,
                                   atol=ATOL)


def test_sharded_transformers_checkpoint_loads_and_saves_in_the_same_shards(tmp_path):
    hf = tiny_moe()
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    shards = sorted(f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors"))
    assert len(shards) > 1
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
    assert saved == shards
    with open(tmp_path / "sharded" / "model.safetensors.index.json") as f:
        theirs = json.load(f)["weight_map"]
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        ours = json.load(f)["weight_map"]
    assert ours == theirs  # every expert tensor back in the shard it came from
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=RTOL, atol=ATOL)


def test_config_alone_builds_the_model_transformers_initialises_alike():
    # A model_type without architectures, and transformers' "num_local_experts" spelling.
    config = config_dict()
    del config["architectures"]
    assert config["model_type"] == "qwen3_moe" and "num_local_experts" in config
    ids, mask, labels = lm_batch()
    with roundpipe.RoundPipe(config, devices=DEVICES, seed=4) as model:
        names = [n for n, _ in model.optim_named_parameters()]
        assert "1.mlp.experts.gate_up_proj" in names and "2.mlp.up_proj.weight" in names
        shapes = {n: tuple(p.shape) for n, p in model.optim_named_parameters()}
        assert shapes["1.mlp.experts.gate_up_proj"] == (4, 32, 32)
        assert shapes["1.mlp.experts.down_proj"] == (4, 32, 16)
        assert shapes["1.mlp.gate.weight"] == (4, 32)
        # normal(0, initializer_range) weights: the first loss is about ln(vocab).
        loss = float(model.forward_backward((ids, mask), label=labels))
        assert abs(loss - torch.log(torch.tensor(float(VOCAB))).item()) < 0.05


def test_unsupported_moe_config_values_are_refused_by_key():
    bad = [
        ({"output_router_logits": True}, "output_router_logits"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"moe_intermediate_size": -16}, "moe_intermediate_size"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"mlp_only_layers": [3]}, "mlp_only_layers"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers"),
        ({"num_experts": 8}, "num_local_experts"),  # disagrees with num_local_experts: 4
        ({"num_local_experts": -1}, "num_local_experts"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"router_aux_loss_coef": "0.001"}, "router_aux_loss_coef"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ]
    for changes, key in bad:
        with pytest.raises(RoundPipeError) as info:
            roundpipe.RoundPipe(config_dict(**changes), devices=DEVICES).close()
        assert info.value.status == roundpipe.Status.INVALID_ARGUMENT, changes
        assert key in info.value.message, (changes, info.value.message)
    # Why the auxiliary loss is refused is part of the message.
    with pytest.raises(RoundPipeError, match="load-balancing loss"):
        roundpipe.RoundPipe(config_dict(output_router_logits=True), devices=DEVICES)
    # With a coefficient of 0 the loss is transformers' causal-LM loss: accepted.
    ok = config_dict(output_router_logits=True, router_aux_loss_coef=0.0)
    roundpipe.RoundPipe(ok, devices=DEVICES).close()


def test_host_memory_check_counts_every_expert_before_allocating():
    # 2 sparse layers of 65,536 experts of width 16,384: 206 G parameters (3.3 TB with their
    # optimizer state), refused by the host check with the exact count, not by an allocation.
    experts, width = 65536, 16384
    config = config_dict(num_local_experts=experts, moe_intermediate_size=width)
    hidden, vocab = 32, VOCAB
    q, kv = 4 * 8, 2 * 8
    attention = hidden * q + 2 * hidden * kv + q * hidden + 2 * 8 + 2 * hidden
    sparse = attention + experts * 3 * width * hidden + experts * hidden
    dense = attention + 3 * 48 * hidden
    want = 2 * sparse + dense + 2 * vocab * hidden + hidden
    with pytest.raises(RoundPipeError) as info:
        roundpipe.RoundPipe(config, devices=DEVICES)
    assert info.value.status == roundpipe.Status.OUT_OF_MEMORY
    assert "%d trainable parameters" % want in info.value.message, info.value.message
