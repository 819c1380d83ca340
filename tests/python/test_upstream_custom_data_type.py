"""Upstream's page "Registering Custom Data Types" (UserGuide_AdvancedUsage_custom_data_type):
types registered with torch.utils._pytree.register_pytree_node cross layers, are split and merged
leaf by leaf (non-tensor context checked), as the page's three examples (a dataclass with a
non-tensor field, optional fields, nested structures); numbers against plain PyTorch."""

import copy
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
from torch.utils._pytree import register_pytree_node  # noqa: E402

from roundpipe import RoundPipe, RoundPipeError, RoundPipeRunConfig  # noqa: E402

DEVICES = ("cpu", 2)
RTOL, ATOL = 1e-5, 1e-6
N = 3


@dataclass
class TransformerOutput:
    logits: torch.Tensor
    hidden_states: torch.Tensor
    loss: float = 0.0


register_pytree_node(
    TransformerOutput,
    lambda obj: ([obj.logits, obj.hidden_states], {"loss": obj.loss}),
    lambda children, context: TransformerOutput(children[0], children[1], context["loss"]))


class FlexibleOutput:
    def __init__(self, logits, attentions=None):
        self.logits = logits
        self.attentions = attentions


def flatten_flexible(obj):
    children = [obj.logits]
    has_attentions = obj.attentions is not None
    if has_attentions:
        children.append(obj.attentions)
    return children, {"has_attentions": has_attentions}


def unflatten_flexible(children, context):
    if context["has_attentions"]:
        logits, attentions = children
    else:
        logits, attentions = children[0], None
    return FlexibleOutput(logits=logits, attentions=attentions)


register_pytree_node(FlexibleOutput, flatten_flexible, unflatten_flexible)


class BatchResult:
    def __init__(self, outputs, metadata):
        self.outputs = outputs
        self.metadata = metadata


register_pytree_node(BatchResult, lambda obj: ([obj.outputs, obj.metadata], None),
                     lambda children, context: BatchResult(children[0], children[1]))


class Encoder(torch.nn.Module):
    def __init__(self, loss=0.0):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.loss = loss

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return TransformerOutput(logits=h * 2, hidden_states=h, loss=self.loss)


class Head(torch.nn.Module):
    def __init__(self, with_attentions=True):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.with_attentions = with_attentions

    def forward(self, out):
        assert isinstance(out, TransformerOutput) and out.loss == 0.5
        logits = self.lin(out.logits + out.hidden_states)
        return FlexibleOutput(logits, out.hidden_states.softmax(-1)
                              if self.with_attentions else None)


class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, flex):
        y = self.lin(flex.logits)
        return BatchResult([y, y * 2], {"attn": flex.attentions, "sum": y.sum(-1)})


def loss_fn(result, label):
    return ((result.outputs[0] - label) ** 2).sum() + result.metadata["attn"].pow(2).sum()


def make(seed=0, with_attentions=True):
    torch.manual_seed(seed)
    return torch.nn.Sequential(Encoder(loss=0.5), Head(with_attentions), Nested())


def test_registered_types_cross_layers_and_train_as_pytorch():
    net = make()
    ref = copy.deepcopy(net)
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    want = sum(float(loss_fn(ref(p), t)) for p, t in zip(x.chunk(N), y.chunk(N)))
    for p, t in zip(x.chunk(N), y.chunk(N)):
        loss_fn(ref(p), t).backward()
    with RoundPipe(net, devices=DEVICES, stage_plan=[1, 1, 1],
                   model_run_config=RoundPipeRunConfig(num_microbatch=N)) as model:
        loss, out = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                                           return_outputs=True)
        assert float(loss) == pytest.approx(want, rel=RTOL)
        # merged: the registered structure back, tensors concatenated
        assert isinstance(out, BatchResult) and isinstance(out.outputs, list)
        with torch.no_grad():
            whole = net(x)
        torch.testing.assert_close(out.outputs[1], whole.outputs[1], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out.metadata["sum"], whole.metadata["sum"], rtol=RTOL,
                                   atol=ATOL)
        model.synchronize()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_dataclass_output_is_split_and_merged_with_its_context_checked():
    torch.manual_seed(0)
    enc = Encoder(loss=0.25)
    x = torch.randn(12, 8)
    with torch.no_grad():
        want = enc(x)
    with RoundPipe(enc, devices=DEVICES) as model, torch.no_grad():
        got = model(x)
        assert isinstance(got, TransformerOutput) and got.loss == 0.25
        torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=RTOL, atol=ATOL)
        packed = model(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False,
                                                                  num_microbatch=N))
        assert len(packed) == N and all(isinstance(p, TransformerOutput) for p in packed)


def test_optional_field_absent():
    torch.manual_seed(0)
    net = torch.nn.Sequential(Encoder(loss=0.5), Head(with_attentions=False))
    x = torch.randn(6, 8)
    with torch.no_grad():
        want = net(x)
    with RoundPipe(net, devices=DEVICES) as model, torch.no_grad():
        got = model(x)
        assert isinstance(got, FlexibleOutput) and got.attentions is None
        torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)


def test_registered_input_is_split_by_its_tensors():
    torch.manual_seed(0)
    head = Head()
    out = TransformerOutput(torch.randn(12, 16), torch.randn(12, 16), loss=0.5)
    with torch.no_grad():
        want = head(out)
    with RoundPipe(head, devices=DEVICES) as model, torch.no_grad():
        got = model(out, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=N))
        torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got.attentions, want.attentions, rtol=RTOL, atol=ATOL)


class Unregistered:
    def __init__(self, t):
        self.t = t


def test_unregistered_types_are_opaque_leaves():
    """Upstream: an unregistered type is one leaf, replicated to every microbatch."""
    class Take(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, box):
            return self.lin(x) + box.t

    torch.manual_seed(0)
    net = Take()
    x, box = torch.randn(6, 4), Unregistered(torch.randn(4))
    with torch.no_grad():
        want = net(x, box)
    with RoundPipe(net, devices=DEVICES) as model, torch.no_grad():
        torch.testing.assert_close(model(x, box), want, rtol=RTOL, atol=ATOL)


def test_differing_context_across_microbatches_is_an_error_when_merged():
    class Varying(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 16)

        def forward(self, x):
            h = self.lin(x)
            return TransformerOutput(h, h, loss=float(x[0, 0]))

    torch.manual_seed(0)
    with RoundPipe(Varying(), devices=DEVICES) as model, torch.no_grad():
        from torch.distributed.pipelining.microbatch import _Replicate
        with pytest.raises(RoundPipeError, match="merge_output"):
            model(torch.randn(6, 8), roundpipe_run_config=RoundPipeRunConfig(
                merge_output=_Replicate))
        # the automatic merge checks the non-tensor field too (the page: "the loss field is
        # checked for consistency")
        with pytest.raises(RoundPipeError, match="not a tensor"):
            model(torch.randn(6, 8))
