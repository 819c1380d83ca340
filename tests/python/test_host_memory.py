"""host_memory="saving": the memory-saving host layout (rp_host_memory_mode) through the binding.

Bytes per parameter, from the header's rp_host_memory_mode comment, once a built-in AdamW step
has allocated the moments (tensor bytes, so they divide exactly by the element count):
  standard: fp32 master 4 + fp32 moments 8 + two fp32 gradient buffers 8 + two model-dtype
            weight copies (bf16: 4, fp32: 8)                      -> bf16 24, fp32 28
  saving:   fp32 master 4 + bf16 moments 4 + one gradient buffer (bf16: 2, fp32: 4) + one
            model-dtype weight copy (bf16: 2, fp32 models upload the master: 0) -> 12 both
Before the first built-in step there are no moments (8 bytes less in standard mode, 4 in
saving mode).
"""

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
import roundpipe._internals  # noqa: E402
import roundpipe.wrap  # noqa: E402

DEVICES = ("cpu", 2)
N_MB = 3
STEPS = 20
BATCH = 24

STATE_BYTES = {  # (host_memory, dtype) -> bytes per parameter after a built-in AdamW step
    ("standard", torch.bfloat16): 24,
    ("standard", torch.float32): 28,
    ("saving", torch.bfloat16): 12,
    ("saving", torch.float32): 12,
}
MOMENT_BYTES = {"standard": 8, "saving": 4}  # of the above: the AdamW moments


def mlp(dtype=torch.float32):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 4)).to(dtype)


def n_elements(module):
    return sum(p.numel() for p in module.parameters())


def data():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, 8, generator=g)
    teacher = torch.randn(8, 4, generator=g) / 3
    return x, torch.tanh(x @ teacher)


def train(model, step_fn, steps=STEPS, is_async=True):
    x, y = data()
    loss = roundpipe.BuiltinLoss("mse", scale=1 / N_MB)
    losses = []
    for _ in range(steps):
        losses.append(float(model.forward_backward((x,), label=y, loss_fn=loss)))
        model.step(step_fn, is_async)
    model.synchronize()
    return losses


def assert_loss_falls(losses):
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert min(losses[-5:]) < 0.5 * losses[0], losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_saving_mode_trains_with_the_builtin_adamw(dtype):
    with roundpipe.RoundPipe(mlp(dtype), devices=DEVICES, seed=1, host_memory="saving") as model:
        assert model.host_memory == "saving"
        assert_loss_falls(train(model, roundpipe.optim.AdamW(lr=1e-2)))
        assert model.step_count == STEPS


def test_saving_mode_trains_with_a_torch_optimizer_on_fp32_gradient_copies():
    with roundpipe.RoundPipe(mlp(torch.bfloat16), devices=DEVICES, seed=1,
                             host_memory="saving") as model:
        params = list(model.optim_parameters())
        assert all(p.dtype == torch.float32 for p in params)  # fp32 master weights
        opt = torch.optim.AdamW(params, lr=1e-2)
        seen = []

        def step_fn():
            # torch.optim needs grad.dtype == param.dtype: the binding hands it fp32 copies of
            # the engine's bf16 gradients.
            seen.append({p.grad.dtype for p in params})
            opt.step()
            opt.zero_grad()

        assert_loss_falls(train(model, step_fn))
        assert seen == [{torch.float32}] * STEPS
        # After synchronize(), .grad is the accumulated gradient: fp32 copies of bf16 values.
        x, y = data()
        model.forward_backward((x,), label=y, loss_fn="mse")
        model.synchronize()
        for p in params:
            assert p.grad.dtype == torch.float32
            assert torch.equal(p.grad, p.grad.to(torch.bfloat16).float())
        assert any(p.grad.abs().sum() > 0 for p in params)


def test_saving_mode_async_steps_are_never_stale():
    # Standard mode: the second call runs on the initial weights (staleness one). Saving mode:
    # each stage waits for the step to pass it, so async training equals sync training.
    with roundpipe.RoundPipe(mlp(), devices=DEVICES, seed=1, host_memory="saving") as a, \
            roundpipe.RoundPipe(mlp(), devices=DEVICES, seed=1, host_memory="saving") as s:
        got = train(a, roundpipe.optim.AdamW(lr=1e-2), steps=4, is_async=True)
        want = train(s, roundpipe.optim.AdamW(lr=1e-2), steps=4, is_async=False)
        assert got[1] != got[0]
        assert got == want
        for (name, wa), (_, ws) in zip(a.state_dict().items(), s.state_dict().items()):
            assert torch.equal(wa, ws), name


@pytest.mark.parametrize("host_memory", ["standard", "saving"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_host_state_bytes_per_parameter(host_memory, dtype):
    module = mlp(dtype)
    elements = n_elements(module)
    want = STATE_BYTES[(host_memory, dtype)]
    with roundpipe.RoundPipe(module, devices=DEVICES, seed=1, host_memory=host_memory) as model:
        before = model.host_state_bytes()
        assert isinstance(before, roundpipe.HostStateBytes)
        assert before.elements == elements
        assert before.bytes == (want - MOMENT_BYTES[host_memory]) * elements
        train(model, roundpipe.optim.AdamW(lr=1e-2), steps=2)
        got = model.host_state_bytes()
        bytes_, elements_, per_param = got  # a named tuple: unpacks too
        assert (bytes_, elements_) == (got.bytes, got.elements) == (want * elements, elements)
        assert per_param == got.bytes_per_param == want
        if host_memory == "saving":
            assert per_param <= 13
        else:
            assert per_param > 20


def test_default_is_standard():
    with roundpipe.RoundPipe(mlp(torch.bfloat16), devices=DEVICES, seed=1) as model:
        assert model.host_memory == "standard"
        train(model, roundpipe.optim.AdamW(lr=1e-2), steps=1)
        assert model.host_state_bytes().bytes_per_param == 24


@pytest.mark.parametrize("bad", ["Saving", "low", "", None, 1, True])
def test_bad_host_memory_raises_value_error_before_anything_is_built(bad, monkeypatch):
    def no_library():
        raise AssertionError("the library was called")

    live = len(roundpipe._internals._live_models)
    monkeypatch.setattr(roundpipe._internals, "lib", no_library)
    with pytest.raises(ValueError, match='"standard" or "saving"'):
        roundpipe.RoundPipe(mlp(), devices=DEVICES, host_memory=bad)

    def no_conversion(module):
        raise AssertionError("the module was converted")

    monkeypatch.setattr(roundpipe.wrap, "sequential_preset", no_conversion)
    with pytest.raises(ValueError, match='"standard" or "saving"'):
        roundpipe.wrap_model_to_roundpipe(mlp(), devices=DEVICES, host_memory=bad)
    assert len(roundpipe._internals._live_models) == live


def test_wrap_model_to_roundpipe_passes_host_memory_on():
    with roundpipe.wrap_model_to_roundpipe(mlp(torch.bfloat16), devices=DEVICES,
                                           host_memory="saving") as model:
        assert model.host_memory == "saving"
        train(model, roundpipe.optim.AdamW(lr=1e-2), steps=1)
        assert model.host_state_bytes().bytes_per_param == 12


def test_saving_mode_reaches_hugging_face_configs():
    config = {  # test_hf.py's tiny Qwen3, smaller, in bf16
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True, "use_sliding_window": False, "attention_bias": False,
        "initializer_range": 0.02, "dtype": "bfloat16"}
    ids = torch.randint(0, 64, (6, 8), generator=torch.Generator().manual_seed(0))
    with roundpipe.RoundPipe(config, devices=DEVICES, seed=1, host_memory="saving") as model:
        model.forward_backward((ids,), label=ids, loss_fn="causal_lm")
        model.step(roundpipe.optim.AdamW(lr=1e-3))
        model.synchronize()
        assert model.host_state_bytes().bytes_per_param == 12
