"""Upstream's pages API_run_config and "RoundPipeRunConfig" (UserGuide_AdvancedUsage_run_config):
the documented signature and defaults, model-level configuration overridden per call field by
field, num_microbatch, recompute_grain, output_device, merge_output (automatic, specs, nested
specs, reducers, functions, False and RoundPipePackedData chaining into another model), on CPU
worker devices against plain PyTorch."""

import copy
import inspect

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining.microbatch import (TensorChunkSpec, _CustomReducer,  # noqa: E402
                                                     _Replicate)

import roundpipe  # noqa: E402
from roundpipe import (RoundPipe, RoundPipeError, RoundPipePackedData,  # noqa: E402
                       RoundPipeRunConfig, RoundPipeUnsupportedError, Status)

DEVICES = ("cpu", 2)
RTOL, ATOL = 1e-5, 1e-6


def mlp(seed=0, out=4, inp=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inp, 16), torch.nn.Tanh(), torch.nn.Linear(16, out))


def mse_sum(out, label):
    return ((out - label) ** 2).sum()


class TwoHeads(torch.nn.Module):
    """A Python layer returning (logits, hidden, mean): a tuple output to merge."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h * 2, h, h.mean()


def test_signature_is_upstreams():
    params = list(inspect.signature(RoundPipeRunConfig).parameters)
    assert params == ["requires_grad", "output_device", "preserve_rng_state", "recompute_grain",
                      "num_microbatch", "split_input", "split_label", "merge_output",
                      "execute_plan"]
    config = RoundPipeRunConfig()
    assert all(getattr(config, p) is None for p in params)


def test_defaults_and_per_call_override_field_by_field():
    with RoundPipe(mlp(), devices=DEVICES,
                   model_run_config=RoundPipeRunConfig(num_microbatch=4)) as model:
        resolved = model.resolved_run_config()
        assert resolved.num_microbatch == 4 and resolved.recompute_grain == "stage"
        assert resolved.output_device == torch.device("cpu") and resolved.merge_output is True
        call = model.resolved_run_config(RoundPipeRunConfig(num_microbatch=8,
                                                            recompute_grain="layer"))
        assert call.num_microbatch == 8 and call.recompute_grain == "layer"
        # and the calls run with them: one packed value per microbatch
        with torch.no_grad():
            out = model(torch.randn(8, 8), roundpipe_run_config=RoundPipeRunConfig(
                merge_output=False))
            assert isinstance(out, RoundPipePackedData) and len(out) == 4
            out = model(torch.randn(8, 8), roundpipe_run_config=RoundPipeRunConfig(
                num_microbatch=8, merge_output=False))
            assert len(out) == 8
    with RoundPipe(mlp(), devices=("cpu", 3)) as model:
        assert model.resolved_run_config().num_microbatch == 4  # devices + 1


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("num_microbatch", [1, 3, 6])
def test_grain_and_microbatches_train_as_pytorch(grain, num_microbatch):
    net = mlp()
    ref = copy.deepcopy(net)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    want = mse_sum(ref(x), y)
    want.backward()
    config = RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain)
    with RoundPipe(net, devices=DEVICES, stage_plan=[1, 1, 1]) as model:
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum,
                                      run_config=config)
        assert float(loss) == pytest.approx(float(want), rel=RTOL)
        model.synchronize()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_output_device_cpu_and_return_outputs():
    net = mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    with RoundPipe(net, devices=DEVICES) as model:
        config = RoundPipeRunConfig(output_device=torch.device("cpu"))
        loss, out = model.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum,
                                           return_outputs=True, run_config=config)
        assert out.device == torch.device("cpu")
        with torch.no_grad():
            torch.testing.assert_close(out, net(x), rtol=RTOL, atol=ATOL)


def test_requires_grad_and_preserve_rng_state_are_accepted():
    config = RoundPipeRunConfig(requires_grad=False, preserve_rng_state=True)
    assert config.requires_grad is False and config.preserve_rng_state is True
    net = mlp()
    x = torch.randn(6, 8)
    with RoundPipe(net, devices=DEVICES, model_run_config=config) as model:
        with torch.no_grad():
            torch.testing.assert_close(
                model(x, roundpipe_run_config=RoundPipeRunConfig(preserve_rng_state=False)),
                net(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kwargs, needle", [
    ({"requires_grad": "yes"}, "requires_grad"),
    ({"preserve_rng_state": 1}, "preserve_rng_state"),
    ({"recompute_grain": "block"}, "recompute_grain"),
    ({"num_microbatch": 0}, "num_microbatch"),
    ({"output_device": "meta"}, "output_device"),
    ({"execute_plan": "auto"}, "execute_plan"),
])
def test_bad_fields_raise_naming_them(kwargs, needle):
    with pytest.raises(RoundPipeError, match=needle) as err:
        RoundPipeRunConfig(**kwargs)
    assert err.value.status == Status.INVALID_ARGUMENT


# ---------------------------------------------------------------------------------------------
# merge_output
# ---------------------------------------------------------------------------------------------


def test_merge_specs_functions_and_reducers_on_a_tensor_output():
    net = mlp()
    x = torch.randn(6, 8)
    with torch.no_grad():
        want = net(x)
    pieces = list(want.split(2))
    with RoundPipe(net, devices=DEVICES, model_run_config=RoundPipeRunConfig(
            num_microbatch=3)) as model, torch.no_grad():
        def run(merge):
            return model(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=merge))
        torch.testing.assert_close(run(None), want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(run(True), want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(run(TensorChunkSpec(0)), want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(run(TensorChunkSpec(1)), torch.cat(pieces, 1), rtol=RTOL,
                                   atol=ATOL)
        sum_reducer = _CustomReducer(torch.tensor(0.0), lambda a, b: a + b)
        torch.testing.assert_close(run(sum_reducer), sum(pieces), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(run(lambda outs: torch.stack(outs)), torch.stack(pieces),
                                   rtol=RTOL, atol=ATOL)
        packed = run(False)
        assert isinstance(packed, RoundPipePackedData) and isinstance(packed, list)
        assert packed.synchronize() is packed or packed.synchronize() is None
        for got, w in zip(packed, pieces):
            torch.testing.assert_close(got, w, rtol=RTOL, atol=ATOL)
        with pytest.raises(RoundPipeError, match="merge_output"):
            run(_Replicate)  # the microbatches differ
        with pytest.raises(RoundPipeError, match="merge_output"):
            run((TensorChunkSpec(0), TensorChunkSpec(0)))  # nested spec, one tensor output


def test_nested_tuple_merge_spec_on_a_tuple_output():
    net = TwoHeads()
    x = torch.randn(6, 8)
    with torch.no_grad():
        whole = [net(p) for p in x.split(2)]
    with RoundPipe(net, devices=DEVICES, model_run_config=RoundPipeRunConfig(
            num_microbatch=3)) as model, torch.no_grad():
        spec = (TensorChunkSpec(0), TensorChunkSpec(1),
                _CustomReducer(torch.tensor(0.0), lambda a, b: a + b))
        a, h, m = model(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=spec))
        torch.testing.assert_close(a, torch.cat([w[0] for w in whole], 0), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(h, torch.cat([w[1] for w in whole], 1), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(m, sum(w[2] for w in whole), rtol=RTOL, atol=ATOL)
        # None inside a spec: the automatic rule (0-d tensors averaged)
        a, h, m = model(x, roundpipe_run_config=RoundPipeRunConfig(
            merge_output=(None, TensorChunkSpec(0), None)))
        torch.testing.assert_close(m, torch.stack([w[2] for w in whole]).mean(), rtol=RTOL,
                                   atol=ATOL)
        # merge_output=False: every leaf a RoundPipePackedData
        a, h, m = model(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False))
        assert all(isinstance(v, RoundPipePackedData) and len(v) == 3 for v in (a, h, m))
        torch.testing.assert_close(m[1], whole[1][2], rtol=RTOL, atol=ATOL)
        with pytest.raises(RoundPipeError, match=r"merge_output is a tuple of 2 specs"):
            model(x, roundpipe_run_config=RoundPipeRunConfig(
                merge_output=(TensorChunkSpec(0), TensorChunkSpec(0))))
        with pytest.raises(RoundPipeError, match=r"merge_output\[2\]: TensorChunkSpec"):
            model(x, roundpipe_run_config=RoundPipeRunConfig(
                merge_output=(None, None, TensorChunkSpec(1))))


def test_packed_outputs_feed_another_model_as_pytorch():
    """merge_output=False's documented purpose: model1's packed output is model2's input."""
    enc, dec = mlp(1, out=16), mlp(2, inp=16)
    ref_enc, ref_dec = copy.deepcopy(enc), copy.deepcopy(dec)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    want = mse_sum(ref_dec(ref_enc(x)), y)
    want.backward()
    with RoundPipe(enc, devices=DEVICES) as model1, RoundPipe(dec, devices=DEVICES) as model2:
        with torch.no_grad():
            hidden = model1(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False))
        assert isinstance(hidden, RoundPipePackedData)
        loss, out = model2.forward_backward(input_args=(hidden,), label=y, loss_fn=mse_sum,
                                            return_outputs=True)
        assert float(loss) == pytest.approx(float(want), rel=RTOL)
        torch.testing.assert_close(out, ref_dec(ref_enc(x)).detach(), rtol=RTOL, atol=ATOL)
        model2.synchronize()
        for p, q in zip(dec.parameters(), ref_dec.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
        # the packed length sets the microbatch count; a different explicit one is an error
        with pytest.raises(RoundPipeError, match="num_microbatch"):
            model2.forward_backward(input_args=(hidden,), label=y, loss_fn=mse_sum,
                                    run_config=RoundPipeRunConfig(num_microbatch=2))
        # packed outputs cannot carry gradients back into model1: refused, not silently dropped
        hidden_grad = model1(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False))
        if hidden_grad[0].requires_grad:
            with pytest.raises(RoundPipeUnsupportedError, match="RoundPipePackedData"):
                model2.forward_backward(input_args=(hidden_grad,), label=y, loss_fn=mse_sum)


class SquareMean(torch.nn.Module):
    """A last layer whose output is the loss: the mean square of its input (0-d)."""

    def forward(self, x):
        return (x ** 2).mean()


def test_default_loss_is_the_output_and_ignores_the_label():
    """Upstream's default loss_fn returns the output and ignores the label, whatever it is: the
    call's loss is the sum of the microbatches' outputs (three by default on two devices), with
    torch's gradients; a label of any type is accepted and changes nothing."""
    torch.manual_seed(4)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4), SquareMean())
    ref = copy.deepcopy(net)
    x = torch.randn(6, 8)
    with RoundPipe(net, devices=DEVICES) as model:
        loss = model.forward_backward(input_args=(x,), label={"ignored": [1, "two"]})
        want = sum(ref(xm) for xm in x.tensor_split(3))
        want.backward()
        assert float(loss) == pytest.approx(want.item(), rel=RTOL)
        model.synchronize()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_forward_backward_back_propagates_into_its_inputs_as_pytorch():
    """Upstream's forward_backward back-propagates into its inputs (API_run_config's
    "model1.forward(...) then model2.forward_backward(input_args=(output1,))"). The fused call
    gives no input gradients, so such a call runs as forward() and loss.backward(): both models'
    gradients, the loss and the outputs equal plain PyTorch's on the two models chained, and a
    leaf input made with requires_grad=True gets torch's x.grad. A built-in loss there is refused
    before anything runs."""
    enc, dec = mlp(1, out=16), mlp(2, inp=16)
    ref_enc, ref_dec = copy.deepcopy(enc), copy.deepcopy(dec)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    with RoundPipe(enc, devices=DEVICES) as model1, RoundPipe(dec, devices=DEVICES) as model2:
        hidden = model1(x)  # a training forward: the merged output carries model1's autograd
        assert hidden.requires_grad and hidden.grad_fn is not None
        loss, out = model2.forward_backward(input_args=(hidden,), label=y, loss_fn=mse_sum,
                                            return_outputs=True)
        want_out = ref_dec(ref_enc(x))
        want = mse_sum(want_out, y)
        want.backward()
        assert loss.dtype == torch.float64 and loss.dim() == 0
        assert float(loss) == pytest.approx(float(want), rel=RTOL)
        torch.testing.assert_close(out, want_out.detach(), rtol=RTOL, atol=ATOL)
        model1.synchronize()
        model2.synchronize()
        for mine, ref in ((enc, ref_enc), (dec, ref_dec)):
            for p, q in zip(mine.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
        leaf = x.clone().requires_grad_(True)
        ref_leaf = x.clone().requires_grad_(True)
        target = torch.randn(6, 16)
        model1.forward_backward(input_args=(leaf,), label=target, loss_fn=mse_sum)
        mse_sum(ref_enc(ref_leaf), target).backward()
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=RTOL, atol=ATOL)
        with pytest.raises(RoundPipeUnsupportedError, match="built-in"):
            model2.forward_backward(input_args=(torch.randn(6, 16, requires_grad=True),),
                                    label=y, loss_fn="mse")


def test_scaled_output_loss_into_inputs_that_require_grad_as_pytorch():
    """BuiltinLoss("output", scale) on inputs that require grad (the forward() and
    loss.backward() path) scales the loss and every gradient as the fused call does: the loss is
    scale times the sum of the microbatches' outputs, x.grad and the weights' gradients are
    torch's for that loss, and the same call on a detached input (the fused path) gives the same
    loss and weight gradients."""
    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4), SquareMean())
    ref = copy.deepcopy(net)
    x = torch.randn(6, 8)
    leaf, ref_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    scaled = roundpipe.BuiltinLoss("output", scale=0.25)
    with RoundPipe(net, devices=DEVICES) as model:
        loss = model.forward_backward(input_args=(leaf,), loss_fn=scaled)
        want = 0.25 * sum(ref(xm) for xm in ref_leaf.tensor_split(3))
        want.backward()
        assert float(loss) == pytest.approx(want.item(), rel=RTOL)
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=RTOL, atol=ATOL)
        model.synchronize()
        chained = [p.grad.clone() for p in net.parameters()]
        for p, q in zip(chained, ref.parameters()):
            torch.testing.assert_close(p, q.grad, rtol=RTOL, atol=ATOL)
        model.zero_grad()
        fused = model.forward_backward(input_args=(x,), loss_fn=scaled)
        assert float(fused) == pytest.approx(float(loss), rel=RTOL)
        model.synchronize()
        for p, q in zip(net.parameters(), chained):
            torch.testing.assert_close(p.grad, q, rtol=RTOL, atol=ATOL)


def test_packed_outputs_chain_through_forward():
    """forward() -> forward(): numbers as PyTorch; a packed input that requires grad in a
    training forward is refused (the engine gives no input gradients), not silently cut off."""
    enc, dec = mlp(1, out=16), mlp(2, inp=16)
    x = torch.randn(6, 8)
    with torch.no_grad():
        want = dec(enc(x))
    with RoundPipe(enc, devices=DEVICES) as model1, RoundPipe(dec, devices=DEVICES) as model2:
        with torch.no_grad():
            hidden = model1(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False))
            torch.testing.assert_close(model2(hidden), want, rtol=RTOL, atol=ATOL)
        hidden = model1(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False))
        if hidden[0].requires_grad:
            with pytest.raises(RoundPipeUnsupportedError, match="RoundPipePackedData"):
                model2(hidden)
            model2.eval()
            torch.testing.assert_close(model2(hidden), want, rtol=RTOL, atol=ATOL)


def test_packed_and_plain_inputs_together_and_mismatched_packs():
    torch.manual_seed(3)

    class Add(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, a, b, scale):
            return self.lin(a + b) * scale

    net = Add()
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    with RoundPipe(net, devices=DEVICES) as model, torch.no_grad():
        packed_a = RoundPipePackedData(list(a.split(2)))
        got = model(packed_a, b, 2.0)
        torch.testing.assert_close(got, net(a, b, 2.0), rtol=RTOL, atol=ATOL)
        with pytest.raises(RoundPipeError, match="same number"):
            model(packed_a, RoundPipePackedData(list(b.split(3))), 2.0)
