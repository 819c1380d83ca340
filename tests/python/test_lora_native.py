"""LoRA on the engine's native decoder layers, through the Python API (issue 18, docs/lora.md):
``RoundPipe(model, lora=...)`` and ``wrap_model_to_roundpipe(get_peft_model(model, ...))``,
against transformers + PEFT.

What is proven, on tiny Qwen3 (tied and untied) and Llama models with random weights, fp32, two
CPU worker devices (one GPU with RP_TEST_DEVICE=cuda, as scripts/gpu-check.sh runs it; PEFT's
reference stays on the CPU) and three microbatches:
- a PEFT model takes the native path (the engine reports its adapters), and its logits, its
  labels= loss and its adapter gradients are PEFT's; only the adapters train;
- ten steps of the engine's AdamW are ten steps of torch.optim.AdamW on PEFT's trainable
  parameters, and the frozen base stays bit-identical (engine masters and the PEFT module);
- adapters saved by save_lora (and by save_pretrained of a PEFT-built model) load in
  PeftModel.from_pretrained with the same logits; the merged save loads in transformers with
  the PEFT model's logits; an adapter directory PEFT wrote loads with load_lora;
- bad adapter directories are refused naming the key or tensor, and change nothing;
- what the engine's adapters cannot express is refused by field name (RoundPipe(..., lora=)),
  or, for a PEFT model given to wrap_model_to_roundpipe, runs on the Python-layer path with a
  warning; LoRA on a model that is not a Hugging Face one is refused;
- lora_dropout trains, deterministically, and the backward's recompute replays the forward's
  masks (a central difference of the loss along the gradient equals the gradient's norm).

B of every PEFT adapter is random (init_lora_weights=False) so that A has a gradient from the
first step. Tolerances (fp32): relative 1e-4 with an absolute floor of 1e-5 for logits, losses
and gradients, as tests/python/test_hf.py: the engine and transformers run the same fp32
operations, differing in summation order inside matrix products and the chunked loss (measured
~1e-7 relative). Merged weights round W + s B A once to fp32 where PEFT adds s B (A x) to W x:
a few ulp more, inside the same tolerance. After ten AdamW steps (lr 1e-2) the adapters' updates
are compared norm-based at 1e-3 and element by element at 2e-4 absolute: AdamW divides by
sqrt(v) + eps, which turns a rounding-level gradient difference on a near-zero gradient into a
step of up to lr in another direction for that one element.
"""

import copy
import json
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

import roundpipe  # noqa: E402
from roundpipe import (LoraConfig, RoundPipeError, RoundPipeRunConfig,  # noqa: E402
                       RoundPipeUnsupportedError)

import os  # noqa: E402

from test_hf import torch_adamw_losses  # noqa: E402

RTOL = 1e-4
ATOL = 1e-5
ON_GPU = os.environ.get("RP_TEST_DEVICE") == "cuda"
if ON_GPU and not torch.cuda.is_available():
    pytest.skip("RP_TEST_DEVICE=cuda but no GPU is visible", allow_module_level=True)
DEVICES = ("cuda", 1) if ON_GPU else ("cpu", 2)
N_MB = 3
VOCAB = 128
R, ALPHA = 4, 8
# The engine's order of projections in a decoder layer (rp_model_lora lists them so).
LAYER_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = ["q_proj", "v_proj", "down_proj"]
# family, tied embeddings, target_modules
MODELS = [("qwen3", True, "all-linear"), ("qwen3", False, TARGETS),
          ("llama", False, ["k_proj", "o_proj", "gate_proj", "up_proj"])]


def tiny_base(family="qwen3", tied=False, seed=0):
    """A transformers Qwen3 / Llama with 2 layers, hidden 64, 4 query : 2 key-value heads,
    random fp32 weights."""
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                 use_cache=False)
    torch.manual_seed(seed)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **sizes))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    return model.float().eval()


def peft_of(base, targets=TARGETS, dropout=0.0, seed=0, **config):
    """PEFT's LoRA on a copy of `base`, A and B random."""
    torch.manual_seed(seed)
    return peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=R, lora_alpha=ALPHA, lora_dropout=dropout, init_lora_weights=False,
        target_modules=targets, **config))


def wrap(model, **kwargs):
    return roundpipe.wrap_model_to_roundpipe(
        model, devices=DEVICES, model_run_config=RoundPipeRunConfig(num_microbatch=N_MB),
        **kwargs)


def lm_batch(batch=6, seq=12, seed=5):
    """Token ids, a mask with right padding in two rows, labels (-100 on padding and on the
    first two tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[1, seq - 4:] = 0
    mask[3, seq - 7:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    return ids, mask, labels


def layer_order(targets):
    if targets == "all-linear":
        return list(LAYER_ORDER)
    return [t for t in LAYER_ORDER if t in targets]


def peft_adapter_names(model_peft):
    """PEFT's trainable tensors under the Hugging Face names the engine gives its adapters:
    PEFT's own names without its "base_model.model." wrapper and adapter name."""
    return {n[len("base_model.model."):].replace(".default.", ".")
            for n, p in model_peft.named_parameters() if p.requires_grad}


def logits_of(model, ids, mask=None):
    with torch.no_grad():
        if isinstance(model, roundpipe.RoundPipe):
            return model(input_ids=ids, attention_mask=mask).logits
        return model(input_ids=ids, attention_mask=mask).logits


def assert_close(got, want, what=""):
    got, want = got.cpu(), want.cpu()  # the engine's outputs stay on the GPU that made them
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL * max(1.0, want.abs().max()),
                               msg=lambda m: "%s: %s" % (what, m))


# ---------------------------------------------------------------------------------------------
# A PEFT model on the native path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,tied,targets", MODELS)
def test_peft_model_is_wrapped_natively_and_computes_peft_logits(family, tied, targets):
    model_peft = peft_of(tiny_base(family, tied), targets)
    ids, mask, _ = lm_batch()
    with wrap(model_peft) as model:
        assert isinstance(model, roundpipe.RoundPipe) and model.num_stages > 1
        assert model.lora == LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                        target_modules=layer_order(targets))
        named = list(model.optim_named_parameters())
        trainable = {model.hf_parameter_name(n) for n, p in named if p.requires_grad}
        assert trainable == peft_adapter_names(model_peft)
        assert len(trainable) == 2 * 2 * len(layer_order(targets))  # A, B x 2 layers
        got, want = logits_of(model, ids, mask), logits_of(model_peft, ids, mask)
        real = mask.bool()  # padding queries may differ (docs/semantics.md); real ones not
        assert_close(got[real], want[real], "logits")
        assert model.config is model_peft.config  # attributes forward to the PEFT model


@pytest.mark.parametrize("family,tied,targets", MODELS)
def test_causal_lm_loss_and_adapter_gradients_match_peft(family, tied, targets):
    model_peft = peft_of(tiny_base(family, tied), targets)
    ref = copy.deepcopy(model_peft)
    ids, mask, labels = lm_batch()
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    want.backward()
    ref_params = dict(ref.named_parameters())
    with wrap(model_peft) as model:
        loss = model.forward_backward((ids, mask), label=labels)
        assert_close(loss, want.detach().double(), "loss")
        model.synchronize()  # the gradients land on the PEFT model's adapters
        n_grads = 0
        for name, p in model_peft.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, name
                continue
            assert float(p.grad.abs().sum()) > 0, name
            assert_close(p.grad, ref_params[name].grad, name)
            n_grads += 1
        assert n_grads == len(peft_adapter_names(ref))


@pytest.mark.parametrize("family,tied", [("qwen3", True), ("llama", False)])
def test_ten_adamw_steps_match_torch_adamw_and_leave_the_base_bit_identical(family, tied):
    base = tiny_base(family, tied)
    original = {n: t.clone() for n, t in base.state_dict().items()}
    model_peft = peft_of(base)
    ref = copy.deepcopy(model_peft)
    peft_before = {n: p.detach().clone() for n, p in model_peft.named_parameters()}
    ids, mask, labels = lm_batch()
    settings = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    theirs = torch_adamw_losses(ref, ids, mask, labels, 10, **settings)
    with wrap(model_peft) as model:
        ours = []
        opt = roundpipe.optim.AdamW(**settings)
        for _ in range(10):
            ours.append(float(model.forward_backward((ids, mask), label=labels)))
            model.step(opt, is_async=False)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=RTOL, atol=0)
        assert ours[-1] < ours[0] - 0.1, ours
        model.synchronize()
        # the engine's frozen masters are the transformers model's weights, bit for bit
        frozen = [(n, p) for n, p in model.optim_named_parameters() if not p.requires_grad]
        assert frozen
        for name, p in frozen:
            assert torch.equal(p, original[model.hf_parameter_name(name)]), name
    ref_params = dict(ref.named_parameters())
    for name, p in model_peft.named_parameters():
        if p.requires_grad:  # synchronize() wrote the trained adapters into the PEFT model
            assert not torch.equal(p, peft_before[name]), name
            # The whole update agrees to 1e-3 (norm-based); single elements to 2e-4 (measured:
            # 1.3e-5 on CPU devices, 1.03e-4 on one H200, whose GEMMs round differently)
            ours_update = (p.detach() - peft_before[name]).double()
            ref_update = (ref_params[name].detach() - peft_before[name]).double()
            assert float((ours_update - ref_update).norm() / ref_update.norm()) < 1e-3, name
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=2e-4)
        else:
            assert torch.equal(p, peft_before[name]), name


def test_adapters_saved_by_save_lora_and_save_pretrained_load_in_peft(tmp_path):
    base = tiny_base()
    model_peft = peft_of(base)
    ids, mask, labels = lm_batch()
    with wrap(model_peft) as model:
        opt = roundpipe.optim.AdamW(lr=1e-2)
        for _ in range(3):
            model.forward_backward((ids, mask), label=labels)
            model.step(opt)  # async: the saves synchronize
        model.save_lora(str(tmp_path / "save_lora"))
        model.save_pretrained(str(tmp_path / "save_pretrained"))  # PEFT's own save
        trained = logits_of(model, ids)
    assert not torch.allclose(trained, logits_of(peft_of(base), ids))  # it did train
    config = json.loads((tmp_path / "save_lora" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", R, ALPHA)
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    for where in ("save_lora", "save_pretrained"):
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / where))
        assert_close(logits_of(loaded, ids), trained, where)
    # load_lora into another PEFT model's wrapper: synchronize() hands them to that model
    other = peft_of(base, seed=3)
    with wrap(other) as model:
        model.load_lora(str(tmp_path / "save_lora"))
        assert_close(logits_of(model, ids), trained, "load_lora")
        model.synchronize()
    assert_close(logits_of(other, ids), trained, "the PEFT model after synchronize()")


def test_loaded_base_weights_reach_the_peft_model_at_synchronize(tmp_path):
    # synchronize() copies frozen weights only after something replaced them
    tiny_base(seed=1).save_pretrained(str(tmp_path / "other_base"))
    other = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "other_base"))
    model_peft = peft_of(tiny_base())
    ids, _, _ = lm_batch()
    with wrap(model_peft) as model:
        model.synchronize()
        model.load_pretrained(str(tmp_path / "other_base"))
        model.synchronize()
        want = logits_of(model, ids)
    base_weights = model_peft.get_base_model().state_dict()
    for name, value in other.state_dict().items():
        if "proj.weight" in name and any(t in name for t in TARGETS):
            name = name.replace(".weight", ".base_layer.weight")
        assert torch.equal(base_weights[name], value), name
    assert_close(logits_of(model_peft, ids), want, "logits")


@pytest.mark.parametrize("family,tied", [("qwen3", True), ("llama", False)])
def test_merged_save_loads_in_transformers_with_the_peft_models_logits(family, tied, tmp_path):
    model_peft = peft_of(tiny_base(family, tied), "all-linear")
    ids, mask, labels = lm_batch()
    with wrap(model_peft) as model:
        opt = roundpipe.optim.AdamW(lr=1e-2)
        for _ in range(3):
            model.forward_backward((ids, mask), label=labels)
            model.step(opt)
        model.save_merged(str(tmp_path / "merged"))
        model.synchronize()  # the PEFT model now holds the trained adapters
    names = safetensors_torch.load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert names and not any("lora" in n for n in names)  # a plain Hugging Face model
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert type(merged) is type(model_peft.get_base_model())
    assert_close(logits_of(merged.eval(), ids, mask), logits_of(model_peft, ids, mask), "logits")


def test_peft_adapter_directory_loads_with_load_lora_and_gives_peft_logits(tmp_path):
    base = tiny_base()
    base.save_pretrained(str(tmp_path / "base"))
    model_peft = peft_of(base)
    model_peft.save_pretrained(str(tmp_path / "adapter"))
    ids, mask, _ = lm_batch()
    # A Hugging Face directory with a peft.LoraConfig (PEFT's default init: B is zero, so the
    # model computes the base model's logits until adapters are loaded).
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS)
    with roundpipe.RoundPipe(str(tmp_path / "base"), lora=lora, devices=DEVICES) as model:
        assert model.lora.target_modules == layer_order(TARGETS)
        assert_close(logits_of(model, ids), logits_of(base, ids), "before load_lora")
        model.load_lora(str(tmp_path / "adapter"))
        assert_close(logits_of(model, ids), logits_of(model_peft, ids), "after load_lora")
        # save_lora names the directory the base came from
        model.save_lora(str(tmp_path / "again"))
        config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tmp_path / "base")
        # a LoRA model not built from PEFT saves merged weights with save_pretrained
        model.save_pretrained(str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert_close(logits_of(merged.eval(), ids), logits_of(model_peft, ids), "merged")


# PEFT's save_pretrained of an all-linear model lists the module paths it adapted
# (model.layers.0.self_attn.q_proj, ...) as target_modules; the engine matches them by suffix.
def test_peft_all_linear_adapter_directory_loads_with_load_lora(tmp_path):
    base = tiny_base()
    model_peft = peft_of(base, "all-linear")
    model_peft.save_pretrained(str(tmp_path / "adapter"))
    ids, _, _ = lm_batch()
    lora = LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear")
    with roundpipe.RoundPipe(base, lora=lora, devices=DEVICES) as model:
        model.load_lora(str(tmp_path / "adapter"))
        assert_close(logits_of(model, ids), logits_of(model_peft, ids), "logits")


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------

A_TENSOR = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tensors(directory, edit):
    path = str(directory / "adapter_model.safetensors")
    tensors = safetensors_torch.load_file(path)
    edit(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


BAD_ADAPTERS = {
    # case: (edit of the directory, what the message must name)
    "rank": (lambda d: _edit_config(d, r=R * 2), '"r"'),
    "target_modules": (lambda d: _edit_config(d, target_modules=["q_proj", "k_proj"]),
                       '"target_modules"'),
    "use_dora": (lambda d: _edit_config(d, use_dora=True), '"use_dora"'),
    "shape": (lambda d: _edit_tensors(d, lambda t: t.update({A_TENSOR: torch.zeros(R + 1, 64)})),
              A_TENSOR),
    "extra tensor": (lambda d: _edit_tensors(d, lambda t: t.update(
        {A_TENSOR.replace("q_proj", "k_proj"): torch.zeros(R, 64)})),
        A_TENSOR.replace("q_proj", "k_proj")),
    "missing tensor": (lambda d: _edit_tensors(d, lambda t: t.pop(A_TENSOR)), A_TENSOR),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_bad_adapter_directory_is_refused_by_name_and_changes_nothing(case, tmp_path):
    edit, named = BAD_ADAPTERS[case]
    ids, mask, labels = lm_batch()
    with wrap(peft_of(tiny_base())) as model:
        model.save_lora(str(tmp_path / "adapter"))
        edit(tmp_path / "adapter")
        before = model.state_dict()
        logits = logits_of(model, ids)
        with pytest.raises(RoundPipeError, match=re.escape(named)):
            model.load_lora(str(tmp_path / "adapter"))
        after = model.state_dict()
        assert list(after) == list(before)
        for name in before:
            assert torch.equal(after[name], before[name]), name
        assert torch.equal(logits_of(model, ids), logits)
        loss = model.forward_backward((ids, mask), label=labels)  # still trains
        model.step(roundpipe.optim.AdamW(lr=1e-2), is_async=False)
        assert torch.isfinite(loss) and not torch.equal(logits_of(model, ids), logits)


def test_lora_on_a_model_that_is_not_a_hugging_face_one_is_refused():
    spec = {"layers": [{"type": "linear", "in": 8, "out": 8}, {"type": "relu"}]}
    with pytest.raises(RoundPipeError, match="LoRA adapters"):
        roundpipe.RoundPipe(spec, lora=LoraConfig(), devices=DEVICES)
    sequential = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with pytest.raises(RoundPipeError, match="LoRA adapters"):
        roundpipe.RoundPipe(sequential, lora={"r": 4}, devices=DEVICES)


UNSUPPORTED = [
    # (peft.LoraConfig arguments, the field the message names)
    (dict(use_dora=True), "use_dora"),
    (dict(use_rslora=True), "use_rslora"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(alpha_pattern={"q_proj": 16}), "alpha_pattern"),
    (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="lora_only"), "bias"),
    (dict(init_lora_weights="gaussian"), "init_lora_weights"),
    (dict(target_modules=r".*\.q_proj"), "regular expression"),
]


@pytest.mark.parametrize("config,field", UNSUPPORTED, ids=[f for _, f in UNSUPPORTED])
def test_peft_config_features_without_a_native_form_are_refused_by_name(config, field):
    config = dict(dict(r=R, lora_alpha=ALPHA, target_modules=TARGETS), **config)
    with pytest.raises(RoundPipeUnsupportedError, match=field):
        roundpipe.RoundPipe(tiny_base(), lora=peft.LoraConfig(**config), devices=DEVICES)


def test_lora_settings_out_of_range_or_unknown_are_refused():
    base = tiny_base()
    with pytest.raises(RoundPipeError, match="lm_head"):  # the engine names the module
        roundpipe.RoundPipe(base, lora=LoraConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(RoundPipeError, match="dropout"):
        roundpipe.RoundPipe(base, lora=LoraConfig(lora_dropout=1.0))
    with pytest.raises(ValueError, match="r must be"):
        roundpipe.RoundPipe(base, lora=LoraConfig(r=0))
    with pytest.raises(TypeError, match="'rank'"):
        roundpipe.RoundPipe(base, lora={"rank": 4})
    with pytest.raises(RoundPipeUnsupportedError, match="LoraConfig"):  # a PEFT model has one
        roundpipe.RoundPipe(peft_of(base), lora=LoraConfig())


@pytest.mark.parametrize("config,field", [(dict(use_rslora=True), "use_rslora"),
                                          (dict(layers_to_transform=[1]), "layers_to_transform")])
def test_peft_model_without_a_native_form_runs_as_python_layers_with_a_warning(config, field):
    model_peft = peft_of(tiny_base(), **config)
    ids, _, _ = lm_batch()
    with pytest.raises(RoundPipeUnsupportedError, match=field):
        roundpipe.RoundPipe(model_peft, devices=DEVICES)  # no silent fallback here
    with pytest.warns(UserWarning, match=field):
        model = wrap(model_peft)
    with model:
        assert model.lora is None  # transformers' and PEFT's modules hold the adapters
        assert_close(logits_of(model, ids), logits_of(model_peft, ids), "logits")


# ---------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------


def _first_call(model_peft, ids, mask, labels):
    """(loss, adapter gradients by PEFT name) of the first training call of a fresh wrap: the
    dropout masks of call 0 (docs/semantics.md, Dropout), the same for every fresh model."""
    with wrap(model_peft) as model:
        loss = float(model.forward_backward((ids, mask), label=labels))
        model.synchronize()
        return loss, {n: p.grad.clone() for n, p in model_peft.named_parameters()
                      if p.requires_grad}


def test_lora_dropout_trains_deterministically_with_masks_replayed_by_the_recompute():
    base = tiny_base()
    ids, mask, labels = lm_batch()
    loss, grads = _first_call(peft_of(base, dropout=0.3), ids, mask, labels)
    loss_again, grads_again = _first_call(peft_of(base, dropout=0.3), ids, mask, labels)
    no_dropout, _ = _first_call(peft_of(base, dropout=0.0), ids, mask, labels)
    assert torch.isfinite(torch.tensor(loss)) and loss != no_dropout
    assert loss == loss_again
    for name in grads:
        assert torch.equal(grads[name], grads_again[name]), name

    # The gradient is that of the loss the forward computed, masks included: along the unit
    # direction d = g / |g| the loss changes at rate |g| (0.65 here). Central difference of
    # step eps = 3e-3: its relative error is curvature, O(eps^2) (measured 2.5e-4, 3.3e-3 at
    # eps = 1e-2), plus fp32 rounding of the loss (~5e-7) over 2 eps |g| (~1e-4). The gradient
    # of the same adapters without dropout is off by half along its own direction: a backward
    # replaying other masks would be too.
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    eps = 3e-3
    moved = []
    for sign in (1, -1):
        model_peft = peft_of(base, dropout=0.3)
        with torch.no_grad():
            for name, p in model_peft.named_parameters():
                if p.requires_grad:
                    p.add_(grads[name] / norm.float(), alpha=sign * eps)
        moved.append(_first_call(model_peft, ids, mask, labels)[0])
    slope = (moved[0] - moved[1]) / (2 * eps)
    assert slope == pytest.approx(float(norm), rel=2e-3)
