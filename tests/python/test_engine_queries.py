"""What the binding asks the engine instead of re-deriving it, checked against expectations
written independently here: the stage plan (rp_model_stage_plan), the run configuration a call
uses (rp_model_resolve_run_config), the microbatch split of one tensor (rp_split_microbatches),
the Hugging Face names of parameters (rp_param_hf_name); and the handle owners of
roundpipe._internals (one close for every handle type)."""

import gc
import json
import struct

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import RoundPipeError, RoundPipeRunConfig, Status, _capi, _internals  # noqa: E402
from roundpipe import _python_layer  # noqa: E402
from rp_reference import MLP_SPEC  # noqa: E402

DEVICES = ("cpu", 2)
IDENTITY = {"layers": [{"type": "linear", "in": 4, "out": 4}]}


# ---------------------------------------------------------------------------------------------
# Stage plan
# ---------------------------------------------------------------------------------------------


def test_automatic_stage_plan_covers_every_layer_once():
    with roundpipe.RoundPipe(MLP_SPEC, devices=DEVICES) as model:
        plan = model.stage_plan()
        assert sum(plan) == len(MLP_SPEC["layers"]) == model.num_layers
        assert len(plan) == model.num_stages and all(n >= 1 for n in plan)


@pytest.mark.parametrize("plan", [[2, 3, 1], [6], [1] * 6])
def test_explicit_stage_plan_is_the_plan_in_force(plan):
    with roundpipe.RoundPipe(MLP_SPEC, devices=DEVICES, stage_plan=plan) as model:
        assert model.stage_plan() == plan
        assert model.num_stages == len(plan)
        x = torch.randn(6, 8)
        assert model(x).shape == (6, 4)  # and it runs with it
        assert model.stage_plan() == plan  # a CPU call does not re-plan


# ---------------------------------------------------------------------------------------------
# Run configuration
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_devices", [1, 2, 3])
def test_default_run_config_is_the_engines(num_devices):
    with roundpipe.RoundPipe(IDENTITY, devices=("cpu", num_devices)) as model:
        resolved = model.resolved_run_config()
        assert resolved.num_microbatch == num_devices + 1  # roundpipe.h: devices + 1
        assert resolved.recompute_grain == "stage"
        assert resolved.output_device == torch.device("cpu")
        assert resolved.merge_output is True
        # and a call runs with it: one output per microbatch when not merged
        pieces = model(torch.randn(8, 4), roundpipe_run_config=RoundPipeRunConfig(
            merge_output=False))
        assert len(pieces) == num_devices + 1


def test_call_fields_override_model_fields_field_by_field():
    level = RoundPipeRunConfig(num_microbatch=2, recompute_grain="layer", merge_output=False)
    with roundpipe.RoundPipe(IDENTITY, devices=DEVICES, model_run_config=level) as model:
        resolved = model.resolved_run_config()
        assert (resolved.num_microbatch, resolved.recompute_grain, resolved.merge_output) == \
            (2, "layer", False)
        resolved = model.resolved_run_config(RoundPipeRunConfig(num_microbatch=5))
        assert (resolved.num_microbatch, resolved.recompute_grain, resolved.merge_output) == \
            (5, "layer", False)
        resolved = model.resolved_run_config(RoundPipeRunConfig(recompute_grain="stage",
                                                                merge_output=True))
        assert (resolved.num_microbatch, resolved.recompute_grain, resolved.merge_output) == \
            (2, "stage", True)
        # The model-level merge_output=False reaches the engine: per-microbatch outputs.
        x = torch.arange(32.0).reshape(8, 4)
        pieces = model(x)
        assert isinstance(pieces, roundpipe.RoundPipePackedData) and len(pieces) == 2
        assert len(model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=4))) == 4
        assert model(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=True)).shape == \
            (8, 4)


def test_python_only_fields_are_overlaid_by_the_binding():
    def merge(outs):
        return len(outs)

    def split(label, n):
        return [label] * n

    level = RoundPipeRunConfig(merge_output=merge, split_label=split)
    with roundpipe.RoundPipe(IDENTITY, devices=DEVICES, model_run_config=level) as model:
        resolved = model.resolved_run_config()
        assert resolved.merge_output is merge and resolved.split_label is split
        assert model(torch.randn(6, 4)) == 3  # the custom merge gets every microbatch
        resolved = model.resolved_run_config(RoundPipeRunConfig(merge_output=True))
        assert resolved.merge_output is True and resolved.split_label is split
        assert model(torch.randn(6, 4), roundpipe_run_config=RoundPipeRunConfig(
            merge_output=True)).shape == (6, 4)


def test_run_config_owner_reads_back_what_was_set_and_unset():
    with _internals.RunConfig.build() as unset:
        assert (unset.num_microbatch, unset.recompute_grain, unset.output_device,
                unset.merge_output) == (0, _capi.RP_GRAIN_DEFAULT, None, -1)
    with _internals.RunConfig.build(num_microbatch=7, recompute_grain=_capi.RP_GRAIN_LAYER,
                                    output_device=(_capi.kDLCPU, 0), merge_output=0) as cfg:
        assert (cfg.num_microbatch, cfg.recompute_grain, cfg.output_device,
                cfg.merge_output) == (7, _capi.RP_GRAIN_LAYER, (_capi.kDLCPU, 0), 0)


# ---------------------------------------------------------------------------------------------
# Microbatch split of one tensor
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,dim,n", [((7, 4), 0, 3), ((2, 6, 4), 1, 3), ((5,), 0, 5),
                                         ((9, 2), 0, 1), ((3, 10), 1, 4)])
def test_split_pieces_equal_torch_tensor_split(shape, dim, n):
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    pieces = _internals.split_microbatches(t, dim, n)
    want = torch.tensor_split(t, n, dim)
    assert len(pieces) == n
    for got, expected in zip(pieces, want):
        assert got.shape == expected.shape and torch.equal(got, expected)
        assert got.data_ptr() == expected.data_ptr()  # views, no copy


def test_split_of_integer_and_non_contiguous_tensors():
    for ids in (torch.arange(40, dtype=torch.int64).reshape(8, 5),
                torch.arange(40, dtype=torch.int32).reshape(8, 5)):
        for got, want in zip(_internals.split_microbatches(ids, 0, 3), torch.tensor_split(ids, 3)):
            assert got.dtype == ids.dtype and torch.equal(got, want)
    transposed = torch.arange(24.0).reshape(4, 6).t()  # [6, 4], not contiguous
    for got, want in zip(_internals.split_microbatches(transposed, 0, 3),
                         torch.tensor_split(transposed, 3)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float64, torch.uint8])
def test_split_of_any_dtype(dtype):
    t = (torch.arange(12).reshape(6, 2) % 3 == 0).to(dtype)
    for got, want in zip(_internals.split_microbatches(t, 0, 4), torch.tensor_split(t, 4)):
        assert got.dtype == dtype and torch.equal(got, want)


def test_replicated_and_zero_d_tensors_go_whole_to_every_microbatch():
    t = torch.randn(2, 3)
    pieces = _internals.split_microbatches(t, _capi.RP_SPLIT_REPLICATE, 4)
    assert len(pieces) == 4 and all(torch.equal(p, t) for p in pieces)
    scalar = torch.tensor(2.5)
    pieces = _internals.split_microbatches(scalar, 0, 3)
    assert [p.shape for p in pieces] == [torch.Size([])] * 3
    assert all(float(p) == 2.5 for p in pieces)


def test_split_pieces_outlive_their_source():
    t = torch.arange(30.0).reshape(10, 3)
    want = [p.clone() for p in torch.tensor_split(t, 3)]
    pieces = _internals.split_microbatches(t, 0, 3)
    del t
    gc.collect()
    _ = [torch.full((10, 3), -1.0) for _ in range(8)]  # would reuse freed memory
    assert all(torch.equal(p, w) for p, w in zip(pieces, want))


def test_split_errors_are_the_engines():
    for t, dim, n in ((torch.randn(2, 4), 0, 3),   # fewer rows than microbatches
                      (torch.randn(6, 4), 2, 3)):  # no such dimension
        with pytest.raises(RoundPipeError) as info:
            _internals.split_microbatches(t, dim, n)
        assert info.value.status == Status.INVALID_ARGUMENT and info.value.message


def test_python_loss_labels_are_split_by_the_engine_rule():
    with roundpipe.RoundPipe(IDENTITY, devices=DEVICES) as model:
        x = torch.arange(28.0).reshape(7, 4)
        label = {"y": x.clone(), "w": torch.arange(7), "scale": torch.tensor(3.0)}
        seen = []
        model.forward_backward((x,), label=label,
                               loss_fn=lambda out, lab: (seen.append(lab), out.sum() * 0)[1])
        assert len(seen) == 3
        for m, (y, w) in enumerate(zip(torch.tensor_split(label["y"], 3),
                                       torch.tensor_split(label["w"], 3))):
            assert torch.equal(seen[m]["y"], y) and torch.equal(seen[m]["w"], w)
            assert float(seen[m]["scale"]) == 3.0
        with pytest.raises(RoundPipeError) as info:  # the engine's error, through the binding
            model.forward_backward((x,), label=torch.randn(2, 4), loss_fn=lambda o, y: o.sum())
        assert info.value.status == Status.INVALID_ARGUMENT


# ---------------------------------------------------------------------------------------------
# Hugging Face names
# ---------------------------------------------------------------------------------------------

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "attention_bias": False,
        "initializer_range": 0.02}
QWEN3 = dict(TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16,
             rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False)
LLAMA = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=5e5,
             tie_word_embeddings=False, mlp_bias=False)


def transformers_state_dict_keys(layers, qk_norm, tied):
    """The state_dict keys of transformers' Qwen3ForCausalLM / LlamaForCausalLM, written out
    from modeling_qwen3.py / modeling_llama.py (without lm_head.weight when tied)."""
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(layers):
        p = "model.layers.%d." % i
        keys += [p + "self_attn.%s_proj.weight" % w for w in "qkvo"]
        keys += [p + "self_attn.%s_norm.weight" % w for w in "qk"] if qk_norm else []
        keys += [p + "mlp.%s_proj.weight" % w for w in ("gate", "up", "down")]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return set(keys) | (set() if tied else {"lm_head.weight"})


@pytest.mark.parametrize("config,qk_norm", [(QWEN3, True), (LLAMA, False),
                                            (dict(QWEN3, tie_word_embeddings=False), True)])
def test_hf_names_are_transformers_state_dict_keys(config, qk_norm, tmp_path):
    with roundpipe.RoundPipe(config, devices=DEVICES) as model:
        names = {n: model.hf_parameter_name(n) for n, _ in model.optim_named_parameters()}
        want = transformers_state_dict_keys(2, qk_norm, config["tie_word_embeddings"])
        assert sorted(names.values()) == sorted(want)  # one engine parameter per name
        assert names["0.weight"] == "model.embed_tokens.weight"
        assert names["2.mlp.up_proj.weight"] == "model.layers.1.mlp.up_proj.weight"
        assert names["3.weight"] == "model.norm.weight"
        # ... and the names save_pretrained writes
        model.save_pretrained(str(tmp_path / "out"))
    with open(tmp_path / "out" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    assert set(header) - {"__metadata__"} == want


def test_hf_names_equal_a_transformers_models_state_dict():
    transformers = pytest.importorskip("transformers")
    for cls, cfg, config in ((transformers.Qwen3ForCausalLM, transformers.Qwen3Config, QWEN3),
                             (transformers.LlamaForCausalLM, transformers.LlamaConfig, LLAMA)):
        kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        hf = cls(cfg(**kwargs))
        with roundpipe.wrap_model_to_roundpipe(hf, devices=DEVICES) as model:
            names = {model.hf_parameter_name(n) for n, _ in model.optim_named_parameters()}
        tied = config["tie_word_embeddings"]
        assert names | ({"lm_head.weight"} if tied else set()) == set(hf.state_dict())


def test_models_not_built_from_hugging_face_have_no_hf_names():
    with roundpipe.RoundPipe(IDENTITY, devices=DEVICES) as model:
        with pytest.raises(RoundPipeError) as info:
            model.hf_parameter_name("0.weight")
        assert info.value.status == Status.STATE


# ---------------------------------------------------------------------------------------------
# Handle owners
# ---------------------------------------------------------------------------------------------


def test_every_owner_closes_once_and_refuses_use_afterwards():
    lent = _internals.BorrowedInputs([torch.randn(4)])
    owners = [_internals.RunConfig.build(num_microbatch=2),
              _internals.ModelOptions(seed=1),
              _internals.Loss.builtin(_capi.RP_LOSS_MSE, 0.5),
              _internals.Optimizer(_capi.RP_OPTIMIZER_SGD),
              _internals.TensorList(_capi.lib().rp_split_microbatches, lent.pointers[0], 0, 2),
              _internals.LayerDef("python:test", _python_layer.FORWARD_TRAMPOLINE,
                                  _python_layer.BACKWARD_TRAMPOLINE,
                                  _python_layer.RELEASE_TRAMPOLINE, 0)]
    with _internals.ModelOptions(seed=2) as options:
        owners.append(_internals.Model(roundpipe.convert.resolve_model(IDENTITY), options))
    assert options.closed
    assert set(type(o._handle) for o in owners) == set(_internals._DESTROY)
    for owner in owners:
        assert not owner.closed
        owner.close()
        owner.close()
        assert owner.closed
        with pytest.raises((RoundPipeError, ValueError)):
            owner.handle


def test_nan_inputs_are_counted_and_their_step_skipped():
    """A nan in the inputs gives a nan loss, counted; the step it feeds is skipped, so the
    weights stay bitwise those before it (torch.optim would write nan into every weight)."""
    model = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 3)), devices="cpu")
    before = {n: p.detach().clone() for n, p in model.optim_named_parameters()}
    x = torch.randn(6, 4)
    x[0, 0] = float("nan")
    loss = model.forward_backward(x, label=torch.randn(6, 3), loss_fn="mse")
    assert torch.isnan(loss)
    model.step(roundpipe.optim.AdamW(lr=0.1))
    model.synchronize()
    assert model.nonfinite_counts() == (1, 1)
    for n, p in model.optim_named_parameters():
        assert torch.equal(p.detach(), before[n])
    model.close()
