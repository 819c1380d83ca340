"""Upstream's "Wrap Model" page (UserGuide_BasicUsage_wrap_model), as it shows it:

- presets: ``wrap_model_to_roundpipe(model, use_sequential_preset=True,
  model_run_config=RoundPipeRunConfig(num_microbatch=4), optim_dtype=torch.float32)`` of a
  transformers Qwen3 gives a RoundPipe whose ``vocab_size`` and ``config`` are the model's;
  ``use_sequential_preset=True`` without a preset raises NotImplementedError;
- custom models: an nn.Sequential "input adapter + blocks + output adapter" through
  ``RoundPipe(model=..., optim_dtype=..., model_run_config=..., pin_model="alloc")``; a block
  writing its own buffer in forward (the page's MyBlock) and making temporaries on
  ``x.device``; trained against plain PyTorch;
- automatic wrapping: ``use_sequential_preset=False`` on a model that is not a Sequential gives
  an AutoRoundPipe whose forward equals the model's and which refuses forward_backward; it
  trains with forward(), loss.backward() and step(step_fn) as the same model in plain PyTorch
  (inner RoundPipes and a parameter the root keeps), step_fn running once per step.

Tolerance: fp32, relative 1e-5 (absolute 1e-6), as the other Python-layer tests.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6
DEVICES = ("cpu", 2)


def test_preset_wrapping_keeps_the_original_models_attributes():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        use_cache=False)
    hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    ids = torch.randint(0, 64, (4, 8))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    model = wrap_model_to_roundpipe(
        hf, use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=4), optim_dtype=torch.float32,
        devices=DEVICES)  # "Additional RoundPipe() constructor arguments can be passed here"
    with model:
        assert isinstance(model, RoundPipe)
        assert model.vocab_size == 64 and model.config is hf.config
        assert model.resolved_run_config().num_microbatch == 4
        model.eval()
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=RTOL, atol=ATOL)


def test_use_sequential_preset_none_says_which_preset_it_took(capsys):
    """API_model: with use_sequential_preset=None "a message is printed if a matching preset
    is found"; True asked for one and says nothing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        use_cache=False)
    hf = transformers.Qwen3ForCausalLM(cfg).float()
    with wrap_model_to_roundpipe(hf, devices=DEVICES):
        pass
    assert "native preset for Qwen3ForCausalLM" in capsys.readouterr().err
    with wrap_model_to_roundpipe(hf, use_sequential_preset=True, devices=DEVICES):
        pass
    assert "preset" not in capsys.readouterr().err


def test_use_sequential_preset_true_without_a_preset_raises_not_implemented():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x)

    with pytest.raises(NotImplementedError, match="no Sequential preset"):
        wrap_model_to_roundpipe(Net(), use_sequential_preset=True, devices=DEVICES)


class MyBlock(nn.Module):
    """The page's MyBlock: reads parameters, writes its own buffer, keeps no Python state."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.register_buffer("acc", torch.zeros(16))

    def forward(self, x):
        out = self.linear(x)
        self.acc.add_(out.mean(dim=0).detach())
        # temporaries on the input's device, not a hard-coded one
        return out * torch.ones(x.shape[0], 1, device=x.device)


def sequential_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(32, 16),                 # input adapter: token ids -> hidden states
        nn.Flatten(),                         # [B, 4, 16] -> [B, 64]
        nn.Linear(64, 16), nn.Tanh(),
        MyBlock(),                            # repeated blocks
        MyBlock(),
        nn.Linear(16, 8),                     # output adapter
    )


def test_custom_sequential_trains_like_plain_pytorch():
    net = sequential_model()
    ref = copy.deepcopy(net)
    model = RoundPipe(
        model=net.to(torch.float32),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
        pin_model="alloc",
        devices=DEVICES,
    )
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with model:
        assert model.num_layers == 7
        for _ in range(3):
            x = torch.randint(0, 32, (8, 4), generator=g)
            y = torch.randn(8, 8, generator=g)

            def loss_fn(out, label):
                return nn.functional.mse_loss(out, label) / 4

            loss = model.forward_backward((x,), label=y, loss_fn=loss_fn)
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            want = 0.0
            for xm, ym in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
                mb_loss = loss_fn(ref(xm), ym)
                mb_loss.backward()
                want += float(mb_loss.detach())
            ref_opt.step()
            ref_opt.zero_grad()
            assert float(loss) == pytest.approx(want, rel=RTOL)
        model.synchronize()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
        # the standalone buffers were written by each block (one add per microbatch forward)
        for i in (4, 5):
            assert float(net[i].acc.abs().sum()) > 0
        model.eval()
        x = torch.randint(0, 32, (8, 4), generator=g)
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), rtol=RTOL, atol=ATOL)


class NotSequential(nn.Module):
    """A model with its own forward over children: automatic splitting's case."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        h = self.encoder(x)
        for block in self.blocks:
            h = torch.relu(block(h)) + h
        return self.head(h)


def test_automatic_wrapping_gives_an_auto_roundpipe():
    torch.manual_seed(0)
    net = NotSequential()
    ref = copy.deepcopy(net)
    x = torch.randn(6, 16)
    model = wrap_model_to_roundpipe(net, use_sequential_preset=False,
                                    optim_dtype=torch.float32, lower_threshold=1 << 30,
                                    upper_threshold=1, devices=DEVICES)
    try:
        assert isinstance(model, roundpipe.AutoRoundPipe)
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), rtol=RTOL, atol=ATOL)
        with pytest.raises(NotImplementedError, match="forward_backward"):
            model.forward_backward((x,))
        assert len(list(model.optim_parameters())) > 0
    finally:
        model.close()


class NotSequentialWithGain(NotSequential):
    """NotSequential plus a parameter of the root's own (too small to be wrapped: it stays a
    torch parameter, trained by autograd beside the inner RoundPipes)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return super().forward(x) * self.gain


def auto_with_sgd():
    """(AutoRoundPipe of a NotSequentialWithGain, its PyTorch copy with SGD, a step_fn running
    one SGD over the AutoRoundPipe's optim_parameters(), the list each step_fn run appends to)."""
    torch.manual_seed(0)
    net = NotSequentialWithGain()
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model = wrap_model_to_roundpipe(net, use_sequential_preset=False,
                                    optim_dtype=torch.float32, lower_threshold=1 << 30,
                                    upper_threshold=1, devices=DEVICES)
    opt = torch.optim.SGD(list(model.optim_parameters()), lr=0.05)
    calls = []

    def step_fn():
        calls.append(1)
        opt.step()
        opt.zero_grad()

    return model, (ref, ref_opt), step_fn, calls


def assert_same_weights(model, ref):
    """Every weight of the AutoRoundPipe (the root's own, then the inner RoundPipes in the
    model's order: torch's order here) equals the PyTorch copy's, parameter by parameter."""
    mine, theirs = list(model.optim_parameters()), list(ref.parameters())
    assert len(mine) == len(theirs)
    for p, q in zip(mine, theirs):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("is_async", [False, True])
def test_auto_roundpipe_trains_as_pytorch(is_async):
    """Upstream: an AutoRoundPipe keeps RoundPipe's forward and optimizer features. forward()
    back-propagates into every inner RoundPipe and the root's own parameter; one torch SGD over
    optim_parameters() in step_fn updates them all once per step (twice would double each
    update), for three steps, as plain PyTorch on a copy."""
    model, (ref, ref_opt), step_fn, calls = auto_with_sgd()
    try:
        assert isinstance(model, roundpipe.AutoRoundPipe)
        assert len(model.roundpipes) == 4  # encoder, blocks.0, blocks.1, head
        names = [n for n, _ in model.named_parameters()]
        assert names[:3] == ["gain", "encoder.0.weight", "encoder.0.bias"]
        assert len(names) == len(list(ref.parameters()))
        for k in range(3):
            g = torch.Generator().manual_seed(k)
            x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            model.step(step_fn, is_async=is_async)
            ref_loss = nn.functional.mse_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
        model.synchronize()
        assert len(calls) == 3
        assert_same_weights(model, ref)
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), rtol=RTOL, atol=ATOL)
        assert all(not rp.training for rp in model.roundpipes)  # eval() reaches them
        with pytest.raises(roundpipe.RoundPipeUnsupportedError, match="own"):
            model.step(roundpipe.optim.SGD(lr=0.1))  # a built-in cannot update `gain`
    finally:
        model.close()


def test_auto_roundpipe_step_skipped_for_inf_drops_every_gradient_of_that_step():
    """A step whose gradients hold inf / nan is skipped (no GradScaler): the first inner
    RoundPipe skips, step_fn does not run, and no inner RoundPipe nor the root's own parameter
    carries that step's gradients into the next one: after a non-finite step and a finite one
    the weights equal PyTorch's after the finite step alone."""
    model, (ref, ref_opt), step_fn, calls = auto_with_sgd()
    try:
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
        bad = x.clone()
        bad[0, 0] = float("inf")
        nn.functional.mse_loss(model(bad), y).backward()
        model.step(step_fn)
        assert calls == []  # skipped
        nn.functional.mse_loss(model(x), y).backward()
        model.step(step_fn)
        assert calls == [1]
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        model.synchronize()
        assert_same_weights(model, ref)
    finally:
        model.close()
