"""Any nn.Module trains through RoundPipe as Python layers (issue 13), against plain PyTorch.

Each test builds a model, deep-copies it as the reference, and runs the same microbatches in the
same order on both: RoundPipe through forward_backward on two CPU worker devices (several
stages, Python layers mixed with built-in ones), the reference as a plain loop of forward,
loss / num_microbatch, backward per microbatch (gradient accumulation), then the same
torch.optim step.

Tolerance: fp32 on both sides, relative 1e-5 (RTOL) as for the engine's own layers, with an
absolute floor ATOL for entries near zero. Both sides run the same torch kernels on the same
microbatches; what differs is the order of the gradient accumulation (the engine sums
microbatch gradients in its own buffers), a few ulp per step that grow slowly over 20 steps.
"""

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6
DEVICES = ("cpu", 2)
N_MB = 3  # the default: number of devices + 1


def split(x, n=N_MB):
    return torch.tensor_split(x, n)


def mean_square_loss_backward(ref, x):
    """The plain PyTorch reference of a forward_backward with the mean-square loss: each
    microbatch's loss back-propagated into `ref`'s .grad, their sum returned."""
    total = 0.0
    for xm in split(x):
        mb = ref(xm).square().mean()
        mb.backward()
        total += float(mb)
    return total


def sgd_step(model, lr=0.05, momentum=0.9):
    """A synchronous torch.optim SGD step over the model's optimizer parameters (frozen ones
    have no .grad and are skipped, as torch.optim does)."""
    opt = torch.optim.SGD(model.optim_parameters(), lr=lr, momentum=momentum)
    return opt


def assert_module_close(got, want, rtol=RTOL, atol=ATOL):
    """Parameters and buffers of two modules of one structure."""
    g, w = got.state_dict(), want.state_dict()
    assert list(g) == list(w)
    for name in w:
        torch.testing.assert_close(g[name], w[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))


# ------------------------------------------------------------------------------------------------
# ResNet-18-style network, written as upstream's ResNet tutorial writes it
# ------------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


def build_resnet(num_classes=10, width=8):
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        BasicBlock(width, width), BasicBlock(width, 2 * width, 2),
        BasicBlock(2 * width, 2 * width), BasicBlock(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(4 * width, num_classes))


def test_resnet_matches_plain_pytorch_over_20_steps():
    torch.manual_seed(0)
    net = build_resnet()
    ref = copy.deepcopy(net)
    model = roundpipe.RoundPipe(net, optim_dtype=torch.float32, devices=DEVICES)
    assert model.num_stages > 1
    criterion = nn.CrossEntropyLoss()
    opt = sgd_step(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        images = torch.randn(6, 3, 32, 32, generator=g)
        labels = torch.randint(0, 10, (6,), generator=g)
        loss, outputs = model.forward_backward(
            input_args=(images,), label=labels, return_outputs=True,
            loss_fn=lambda out, lab: criterion(out.float(), lab) / N_MB)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref.train()
        want, want_out = 0.0, []
        for xm, ym in zip(split(images), split(labels)):
            out = ref(xm)
            mb_loss = criterion(out, ym) / N_MB
            mb_loss.backward()
            want += float(mb_loss.detach())
            want_out.append(out.detach())
        ref_opt.step()
        ref_opt.zero_grad()
        assert float(loss) == pytest.approx(want, rel=RTOL), "step %d" % step
        torch.testing.assert_close(outputs, torch.cat(want_out), rtol=RTOL, atol=ATOL)
    model.synchronize()
    # the user's module holds the latest weights and BatchNorm statistics after synchronize()
    assert_module_close(net, ref, rtol=1e-4, atol=1e-5)
    assert_module_close(model.copy_to_module(copy.deepcopy(ref)), ref, rtol=1e-4, atol=1e-5)
    # evaluation mode: running statistics, as the reference in eval()
    ref.eval()
    x = torch.randn(6, 3, 32, 32, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-5)
    model.close()


# The tolerance of the final weights above is 1e-4: 20 SGD steps with momentum amplify the
# per-step ulp differences of the accumulated gradients (BatchNorm's division by the batch
# variance included); the per-step losses and outputs stay within 1e-5.


# ------------------------------------------------------------------------------------------------
# Pytrees between layers; several positional and keyword inputs
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    scale: float


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x, bias, *, gate=None, tag="t"):
        h = self.lin(x) + bias
        if gate is not None:
            h = h * gate
        return {"h": h, "skip": x.sum(-1, keepdim=True), "tag": tag}


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, d):
        assert d["tag"] == "t"  # non-tensor leaves come back
        return torch.tanh(self.lin(d["h"])) + d["skip"], d["h"]


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, a, b):  # a tuple output is the next layer's positional arguments
        return Hidden(self.lin(a) * b, scale=0.5)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, hidden):
        return {"logits": self.lin(hidden.h) * hidden.scale, "aux": hidden.h.mean()}


def chain(seq, *args, **kwargs):
    """upstream's Sequential semantics written out: the first layer takes the call's inputs,
    a tuple output is the next layer's positional arguments, anything else its argument."""
    value = None
    for i, layer in enumerate(seq):
        value = layer(*args, **kwargs) if i == 0 else \
            layer(*value) if type(value) is tuple else layer(value)
    return value


def test_layers_pass_tuples_dicts_and_dataclasses():
    torch.manual_seed(0)
    net = nn.Sequential(Embed(), Mix(), Pair(), Head())
    ref = copy.deepcopy(net)
    model = roundpipe.RoundPipe(net, devices=DEVICES)
    x = torch.randn(6, 4)
    bias = torch.randn(6, 8)
    gate = torch.rand(6, 8)
    y = torch.randn(6, 3)

    def loss_fn(out, label):
        return F.mse_loss(out["logits"], label["y"]) + 0.1 * out["aux"]

    loss, out = model.forward_backward((x, bias), {"gate": gate}, label={"y": y},
                                       loss_fn=loss_fn, return_outputs=True)
    want = 0.0
    for xm, bm, gm, ym in zip(split(x), split(bias), split(gate), split(y)):
        mb = loss_fn(chain(ref, xm, bm, gate=gm), {"y": ym})
        mb.backward()
        want += float(mb.detach())
    assert float(loss) == pytest.approx(want, rel=RTOL)
    # merged outputs: tensors with dimensions concatenated, 0-d averaged, structure kept
    with torch.no_grad():
        whole = [chain(ref, xm, bm, gate=gm) for xm, bm, gm in zip(split(x), split(bias), split(gate))]
    assert set(out) == {"logits", "aux"}
    torch.testing.assert_close(out["logits"], torch.cat([w["logits"] for w in whole]),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out["aux"], torch.stack([w["aux"] for w in whole]).mean(),
                               rtol=RTOL, atol=ATOL)
    model.synchronize()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))
    # merge_output=False: the output's structure, each leaf a RoundPipePackedData holding its
    # value in every microbatch (upstream's API_run_config, "No Merging")
    per_mb = model(x, bias, gate=gate,
                   roundpipe_run_config=RoundPipeRunConfig(merge_output=False))
    assert isinstance(per_mb, dict) and set(per_mb) == {"logits", "aux"}
    assert all(isinstance(v, roundpipe.RoundPipePackedData) and len(v) == N_MB
               for v in per_mb.values())
    model.close()


# ------------------------------------------------------------------------------------------------
# A custom attention block with its own masking
# ------------------------------------------------------------------------------------------------


class MaskedAttention(nn.Module):
    """Causal self-attention that also hides padded keys (mask from the lengths it is given)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, lengths):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        pos = torch.arange(t, device=x.device)
        mask = (pos[None, :] > pos[:, None])[None, None] | \
            (pos[None, None, None, :] >= lengths[:, None, None, None])
        scores = scores.masked_fill(mask, float("-inf"))
        att = torch.softmax(scores, -1).nan_to_num(0.0)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return x + self.out(y), lengths


class Pool(nn.Module):
    def forward(self, x, lengths):
        keep = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).to(x.dtype)
        return (x * keep[..., None]).sum(1) / lengths[:, None].to(x.dtype)


def test_custom_attention_block_with_masking():
    torch.manual_seed(0)
    net = nn.Sequential(MaskedAttention(16, 4), MaskedAttention(16, 4), Pool(), nn.Linear(16, 2))
    ref = copy.deepcopy(net)
    model = roundpipe.RoundPipe(net, devices=DEVICES)
    opt = sgd_step(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(6, 5, 16, generator=g)
        lengths = torch.randint(1, 6, (6,), generator=g)
        y = torch.randn(6, 2, generator=g)
        loss = model.forward_backward((x, lengths), label=y,
                                      loss_fn=lambda o, lab: F.mse_loss(o, lab) / N_MB)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        want = 0.0
        for xm, lm, ym in zip(split(x), split(lengths), split(y)):
            mb = F.mse_loss(chain(ref, xm, lm), ym) / N_MB
            mb.backward()
            want += float(mb.detach())
        ref_opt.step()
        ref_opt.zero_grad()
        assert float(loss) == pytest.approx(want, rel=RTOL), "step %d" % step
    model.synchronize()
    assert_module_close(net, ref)
    model.close()


# ------------------------------------------------------------------------------------------------
# Dropout under recompute; data saved for the recompute
# ------------------------------------------------------------------------------------------------


class DropBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.lin(x))) + x


def test_dropout_masks_match_between_forward_and_recompute():
    """Gradients of a model with dropout equal those of a reference that does not recompute
    and applies the masks the forward drew: recomputing with the call's seed redraws the same
    mask. The masks are recovered from the outputs (dropout scales kept units by 2)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), DropBlock(8), DropBlock(8), nn.Linear(8, 1))
    model = roundpipe.RoundPipe(net, devices=DEVICES)
    x = torch.randn(6, 8)
    masks = {}

    def hook(index):
        def record(module, inputs, output):
            # forward and recompute both run this: the recompute's mask must equal the first
            key = (index, tuple(inputs[0].shape), float(inputs[0].detach().sum()))
            mask = (output.detach() != 0)
            if key in masks:
                assert torch.equal(masks[key], mask), "recompute drew another dropout mask"
            masks[key] = mask
        return record

    for i in (1, 2):
        net[i].drop.register_forward_hook(hook(i))
    loss = model.forward_backward((x,), loss_fn=lambda o, lab: o.square().mean())
    model.synchronize()
    assert masks, "the dropout layers did not run"
    # reference without recompute: the same masks, applied by hand
    ref = copy.deepcopy(net)
    for p in ref.parameters():
        p.grad = None
    want = 0.0
    for xm in split(x):
        h = ref[0](xm)
        for i in (1, 2):
            block = ref[i]
            a = torch.relu(block.lin(h))
            key = (i, tuple(a.shape), float(a.detach().sum()))
            h = a * masks[key] * 2.0 + h
        mb = ref[3](h).square().mean()
        mb.backward()
        want += float(mb.detach())
    assert float(loss) == pytest.approx(want, rel=RTOL)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))
    model.close()


class Router(nn.Module):
    """Upstream's MoE example in small: the routing is saved in the forward and replayed in
    the recompute."""

    def __init__(self, dim, counts):
        super().__init__()
        self.gate = nn.Linear(dim, 2)
        self.experts = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])
        self.counts = counts

    def forward(self, x):
        if roundpipe.doing_recompute():
            choice, = roundpipe.get_recompute_data()
            self.counts["replayed"] += 1
        else:
            choice = self.gate(x).argmax(-1)
            roundpipe.save_for_recompute(choice)
            self.counts["saved"] += 1
        out = torch.stack([e(x) for e in self.experts], 1)
        return out[torch.arange(x.shape[0]), choice] + x


def test_save_for_recompute_replays_forward_data():
    torch.manual_seed(0)
    counts = {"saved": 0, "replayed": 0}
    net = nn.Sequential(Router(8, counts), Router(8, counts), nn.Linear(8, 1))
    ref = copy.deepcopy(net)
    model = roundpipe.RoundPipe(net, devices=DEVICES)
    x = torch.randn(6, 8)
    loss = model.forward_backward((x,), loss_fn=lambda o, lab: o.square().mean())
    assert counts["replayed"] > 0  # a recompute ran and read what its forward saved
    assert not roundpipe.doing_recompute()
    with pytest.raises(AssertionError):
        roundpipe.get_recompute_data()
    assert float(loss) == pytest.approx(mean_square_loss_backward(ref, x), rel=RTOL)
    model.synchronize()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        if q.grad is None:
            continue  # the gate gets no gradient (argmax)
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))
    model.close()


class SometimesScaled(nn.Module):
    """Multiplies by `scale` only for a microbatch whose first input is positive, so `scale` can
    get its gradient from earlier microbatches and none from the last one."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        y = self.lin(x)
        return y * self.scale if bool(x[0, 0] > 0) else y


def test_gradient_from_earlier_microbatches_only():
    # The engine sends a stage's gradients off the device as autograd finalises them during the
    # last microbatch's backward: what it sends must be the sum over every microbatch, also for
    # a parameter to which the last microbatch contributes nothing.
    torch.manual_seed(0)
    net = nn.Sequential(SometimesScaled(8), nn.Linear(8, 1))
    ref = copy.deepcopy(net)
    model = roundpipe.RoundPipe(net, devices=DEVICES)
    x = torch.randn(6, 8)
    x[:, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, -1.0])  # only microbatch 0 scales
    loss = model.forward_backward((x,), loss_fn=lambda o, lab: o.square().mean())
    assert float(loss) == pytest.approx(mean_square_loss_backward(ref, x), rel=RTOL)
    assert ref[0].scale.grad is not None and ref[0].scale.grad.abs().sum() > 0
    model.synchronize()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: "%s: %s" % (name, m))
    model.close()


# ------------------------------------------------------------------------------------------------
# Frozen layers
# ------------------------------------------------------------------------------------------------


def test_frozen_layers_stay_bit_identical_without_optimizer_state():
    torch.manual_seed(0)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), BlockWithNorm(32), nn.Linear(32, 4))

    frozen_net = build()
    for p in list(frozen_net[0].parameters()) + list(frozen_net[2].lin.parameters()):
        p.requires_grad_(False)
    before = copy.deepcopy(frozen_net)
    model = roundpipe.RoundPipe(frozen_net, devices=DEVICES)
    full = roundpipe.RoundPipe(build(), devices=DEVICES)
    g = torch.Generator().manual_seed(5)
    adamw = roundpipe.optim.AdamW(lr=1e-2)
    for _ in range(10):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        for m in (model, full):
            m.forward_backward((x,), label=y, loss_fn=lambda o, lab: F.mse_loss(o, lab))
            m.step(adamw)
    model.synchronize()
    for name in ("0.weight", "0.bias", "2.lin.weight", "2.lin.bias"):
        assert torch.equal(frozen_net.state_dict()[name], before.state_dict()[name]), name
    assert not torch.equal(frozen_net[3].weight, before[3].weight)  # the rest trains
    assert frozen_net[0].weight.grad is None
    # no gradient and no optimizer state for the frozen parameters
    assert model.host_state_bytes().bytes < full.host_state_bytes().bytes
    trainable = {n for n, p in model.optim_named_parameters() if p.requires_grad}
    assert trainable == {"2.norm.weight", "2.norm.bias", "3.weight", "3.bias"}
    model.close()
    full.close()


class BlockWithNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)))


# ------------------------------------------------------------------------------------------------
# wrap_model_to_roundpipe's recursion: a ModuleList model
# ------------------------------------------------------------------------------------------------


class ModuleListNet(nn.Module):
    """A model that loops over an nn.ModuleList in its own forward (not a Sequential)."""

    def __init__(self, dim=64, depth=3):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([BlockWithNorm(dim) for _ in range(depth)])
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def test_module_list_model_through_wrap_model_to_roundpipe():
    """Upstream's recursion: the root has too few parameters of its own and is too large, so
    its children are wrapped: the Linear adapters as one-layer RoundPipes (num_microbatch 1,
    being small), the ModuleList element by element; the root's own loop runs on the calling
    thread (AutoRoundPipe: forward, no fused forward_backward, as upstream)."""
    torch.manual_seed(0)
    net = ModuleListNet()
    ref = copy.deepcopy(net)
    wrapped = roundpipe.wrap_model_to_roundpipe(net, devices=DEVICES)
    assert isinstance(wrapped, roundpipe.AutoRoundPipe)
    assert len(wrapped.roundpipes) == 5  # inp, 3 blocks, out
    x = torch.randn(6, 4)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), ref.eval()(x), rtol=RTOL, atol=ATOL)
    with pytest.raises(roundpipe.RoundPipeUnsupportedError):
        wrapped.forward_backward((x,))
    # skip_modules keeps a module as it is; a Sequential root is one multi-layer RoundPipe
    net2 = ModuleListNet()
    auto = roundpipe.wrap_model_to_roundpipe(net2, devices=DEVICES, skip_modules=[net2.out])
    assert len(auto.roundpipes) == 4 and isinstance(net2.out, nn.Linear)
    auto.close()
    wrapped.close()
    seq = nn.Sequential(nn.Linear(4, 8), BlockWithNorm(8), nn.Linear(8, 2))
    with roundpipe.wrap_model_to_roundpipe(seq, devices=DEVICES) as model:
        assert isinstance(model, roundpipe.RoundPipe) and model.num_layers == 3
