"""Upstream's entry points: RoundPipe(nn.Sequential(...)) and wrap_model_to_roundpipe convert
supported torch modules to an engine spec and copy their weights; weights come back out
through state_dict / copy_to_module / save + load.

Tolerance: fp32 relative 1e-5 with a 1e-6 absolute floor (see test_training.py)."""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import roundpipe  # noqa: E402
from rp_reference import microbatch_grads  # noqa: E402

DEVICES = ("cpu", 2)
N_MB = 3
TOL = dict(rtol=1e-5, atol=1e-6)


def sequential():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(approximate="tanh"),
              nn.Sequential(nn.Linear(16, 16), nn.SiLU()), nn.Identity(), nn.Tanh(),
              nn.Dropout(0.25)]
    if hasattr(nn, "RMSNorm"):
        layers.append(nn.RMSNorm(16, eps=1e-6))
    layers += [nn.ReLU(), nn.Linear(16, 4, bias=False)]
    return nn.Sequential(*layers)


def test_sequential_converts_to_the_documented_spec():
    spec = roundpipe.spec_json(sequential())
    types = [layer["type"] for layer in spec["layers"]]
    assert types[:6] == ["linear", "layer_norm", "gelu", "linear", "silu", "tanh"]
    assert spec["layers"][2]["approximate"] == "tanh"
    assert spec["layers"][-1] == {"type": "linear", "in": 16, "out": 4, "bias": False}
    assert {"type": "dropout", "p": 0.25} in spec["layers"]


def test_sequential_forward_and_gradients_match_the_module():
    module = sequential().eval()
    with roundpipe.RoundPipe(module, devices=DEVICES) as model:
        assert model.num_layers == len(roundpipe.spec_json(module)["layers"])
        x = torch.randn(9, 8)
        torch.testing.assert_close(model(x), module(x).detach(), **TOL)
        # gradients without dropout's randomness: a copy of the module without the Dropout
        no_drop = nn.Sequential(*[m for m in module if not isinstance(m, nn.Dropout)])
        with roundpipe.RoundPipe(no_drop, devices=DEVICES) as model2:
            y = torch.randn(9, 4)
            loss = model2.forward_backward((x,), label=y, loss_fn="mse")
            model2.synchronize()
            no_drop.zero_grad()
            want = microbatch_grads(no_drop, x, y, N_MB, nn.functional.mse_loss)
            assert float(loss) == pytest.approx(want, rel=1e-5)
            module_grads = [p.grad for p in no_drop.parameters()]
            got = [p.grad for p in model2.parameters()]
            assert len(got) == len(module_grads)
            for g, w in zip(got, module_grads):
                torch.testing.assert_close(g, w, **TOL)


def test_embedding_model_takes_int64_inputs():
    torch.manual_seed(1)
    module = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3))
    with roundpipe.RoundPipe(module, devices=DEVICES) as model:
        ids = torch.randint(0, 10, (6, 3))
        torch.testing.assert_close(model(ids), module(ids).detach(), **TOL)


def test_copy_to_module_and_state_dict_after_training():
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    with roundpipe.RoundPipe(module, devices=DEVICES) as model:
        assert model.model is module
        assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        before = {k: v.clone() for k, v in module.state_dict().items()}
        x, y = torch.randn(6, 8), torch.randn(6, 2)
        model.forward_backward((x,), label=y, loss_fn="mse")
        model.step(roundpipe.optim.SGD(lr=0.5), is_async=False)
        model.copy_to_module()
        after = module.state_dict()
        assert set(after) == {"0.weight", "0.bias", "2.0.weight", "2.0.bias"}
        assert not torch.equal(before["2.0.weight"], after["2.0.weight"])
        torch.testing.assert_close(after["2.0.weight"], model.state_dict()["2.weight"])


def test_attribute_forwarding_to_the_original_model():
    module = nn.Sequential(nn.Linear(2, 2))
    module.vocab_size = 123
    with roundpipe.RoundPipe(module, devices=DEVICES) as model:
        assert model.vocab_size == 123
        with pytest.raises(AttributeError):
            model.no_such_attribute
        model.set_original_model(type("Cfg", (), {"vocab_size": 7})())
        assert model.vocab_size == 7


def test_load_state_dict_and_save_load_roundtrip(tmp_path):
    spec = {"layers": [{"type": "linear", "in": 4, "out": 3}, {"type": "relu"},
                       {"type": "layer_norm", "dim": 3}]}
    with roundpipe.RoundPipe(spec, devices=DEVICES, seed=1) as a, \
            roundpipe.RoundPipe(spec, devices=DEVICES, seed=2) as b:
        assert not torch.equal(a.state_dict()["0.weight"], b.state_dict()["0.weight"])
        path = tmp_path / "weights.safetensors"
        a.save(path)
        b.load(path)
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), k
        x = torch.randn(6, 4)
        assert torch.equal(a(x), b(x))
        with pytest.raises(roundpipe.RoundPipeError) as info:
            b.load(tmp_path / "missing.safetensors")
        assert info.value.status == roundpipe.Status.IO and "missing.safetensors" in \
            info.value.message
        new = {k: torch.full_like(v, 0.5) for k, v in a.state_dict().items()}
        b.load_state_dict(new)
        assert all(torch.equal(v, new[k]) for k, v in b.state_dict().items())
        with pytest.raises(roundpipe.RoundPipeError):
            b.load_state_dict({"0.weight": torch.zeros(3, 4)})  # strict: missing keys
        with pytest.raises(roundpipe.RoundPipeError):
            b.load_state_dict({**new, "0.weight": torch.zeros(4, 4)})  # shape


def test_wrap_model_to_roundpipe_builds_a_roundpipe():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with roundpipe.wrap_model_to_roundpipe(module, devices=DEVICES) as model:
        assert isinstance(model, roundpipe.RoundPipe)
        assert model.name.startswith("test_conversion.py:")
        x = torch.randn(3, 4)
        torch.testing.assert_close(model(x), module(x).detach(), **TOL)
    with roundpipe.wrap_model_to_roundpipe(nn.Linear(4, 2), devices=DEVICES) as single:
        assert single.num_layers == 1
