"""Upstream's page "Custom Microbatch Splitting" (UserGuide_AdvancedUsage_custom_microbatch_split):
automatic splitting, split_input specs and functions, split_label specs and functions,
merge_output specs and functions, each against plain PyTorch run microbatch by microbatch (the
page's semantics: the call is the sum of the microbatch losses)."""

import copy
from collections import namedtuple

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining.microbatch import (TensorChunkSpec, _CustomReducer,  # noqa: E402
                                                     _Replicate)

from roundpipe import RoundPipe, RoundPipeError, RoundPipeRunConfig  # noqa: E402

DEVICES = ("cpu", 2)
RTOL, ATOL = 1e-5, 1e-6
N = 3


class Scaled(torch.nn.Module):
    """forward(images, scale_factor): images [B, 8], scale_factor [8] (shared, replicated)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, images, scale_factor):
        return self.lin(images * scale_factor)


class Positions(torch.nn.Module):
    """forward(tokens, position_ids): tokens [B, 8], position_ids [8, B] (split along dim 1)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, tokens, position_ids):
        return self.lin(tokens + position_ids.t())


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, images=None, masks=None, input_ids=None, attention_mask=None,
                position_ids=None):
        if images is None:
            images, masks = input_ids + position_ids, attention_mask
        return self.lin(images * masks)


Out = namedtuple("Out", ["logits", "hidden"])


class WithLogits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.lin(x)
        return Out(h * 3, h)


def per_microbatch_reference(net, pieces, labels, loss_fn):
    """The page's semantics: loss and backward per microbatch, losses summed."""
    ref = copy.deepcopy(net)
    total = 0.0
    for (args, kwargs), label in zip(pieces, labels):
        loss = loss_fn(ref(*args, **kwargs), label)
        loss.backward()
        total += float(loss)
    return total, ref


def check(model, net, ref, loss, want):
    assert float(loss) == pytest.approx(want, rel=RTOL)
    model.synchronize()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def mse_mean(out, label):
    return ((out - label) ** 2).mean()


def test_automatic_splitting_along_dim_0_scalars_replicated():
    torch.manual_seed(0)
    net = Scaled()
    images, scale, y = torch.randn(12, 8), torch.randn(8), torch.randn(12, 4)
    with torch.no_grad():
        want = net(images, torch.tensor(2.0))
    with RoundPipe(net, devices=DEVICES) as model, torch.no_grad():
        # a 0-d tensor and a Python number go whole to every microbatch
        torch.testing.assert_close(model(images, torch.tensor(2.0)), want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(model(images, 2.0), want, rtol=RTOL, atol=ATOL)


def test_split_input_spec_chunk_and_replicate():
    torch.manual_seed(0)
    net = Scaled()
    images, scale, y = torch.randn(12, 8), torch.randn(8), torch.randn(12, 4)
    pieces = [((i, scale), {}) for i in images.chunk(N)]
    want, ref = per_microbatch_reference(net, pieces, y.chunk(N), mse_mean)
    config = RoundPipeRunConfig(num_microbatch=N, split_input=(
        (TensorChunkSpec(0), _Replicate), None))
    with RoundPipe(net, devices=DEVICES, model_run_config=config) as model:
        loss = model.forward_backward(input_args=(images, scale), label=y, loss_fn=mse_mean)
        check(model, net, ref, loss, want)


def test_split_input_spec_along_a_non_batch_dimension():
    torch.manual_seed(0)
    net = Positions()
    tokens, pos, y = torch.randn(12, 8), torch.randn(8, 12), torch.randn(12, 4)
    pieces = [((t, p), {}) for t, p in zip(tokens.chunk(N), pos.chunk(N, dim=1))]
    want, ref = per_microbatch_reference(net, pieces, y.chunk(N), mse_mean)
    config = RoundPipeRunConfig(num_microbatch=N, split_input=(
        (TensorChunkSpec(0), TensorChunkSpec(1)), None))
    with RoundPipe(net, devices=DEVICES) as model:
        loss = model.forward_backward(input_args=(tokens, pos), label=y, loss_fn=mse_mean,
                                      run_config=config)
        check(model, net, ref, loss, want)


def test_split_input_functions_positional_and_keyword():
    torch.manual_seed(0)
    net = Masked()
    images, masks, y = torch.randn(12, 8), (torch.rand(12, 8) > 0.3).float(), torch.randn(12, 4)

    def custom_split(args, kwargs, num_microbatch):
        images, masks = args
        chunks_images = images.chunk(num_microbatch)
        chunks_masks = masks.chunk(num_microbatch)
        args_list = [(img, mask) for img, mask in zip(chunks_images, chunks_masks)]
        kwargs_list = [kwargs] * num_microbatch
        return args_list, kwargs_list

    pieces = [((i, m), {}) for i, m in zip(images.chunk(N), masks.chunk(N))]
    want, ref = per_microbatch_reference(net, pieces, y.chunk(N), mse_mean)
    with RoundPipe(net, devices=DEVICES) as model:
        loss = model.forward_backward(
            input_args=(images, masks), label=y, loss_fn=mse_mean,
            run_config=RoundPipeRunConfig(num_microbatch=N, split_input=custom_split))
        check(model, net, ref, loss, want)

    def split_transformer_input(args, kwargs, num_microbatch):
        input_ids_chunks = kwargs["input_ids"].chunk(num_microbatch)
        mask_chunks = kwargs["attention_mask"].chunk(num_microbatch)
        pos_chunks = kwargs["position_ids"].chunk(num_microbatch)
        args_list = [()] * num_microbatch
        kwargs_list = [{"input_ids": ids, "attention_mask": mask, "position_ids": pos}
                       for ids, mask, pos in zip(input_ids_chunks, mask_chunks, pos_chunks)]
        return args_list, kwargs_list

    torch.manual_seed(1)
    net = Masked()
    ids, pos = torch.randn(12, 8), torch.randn(12, 8)
    kw = {"input_ids": ids, "attention_mask": masks, "position_ids": pos}
    pieces = [((), {"input_ids": a, "attention_mask": b, "position_ids": c})
              for a, b, c in zip(ids.chunk(N), masks.chunk(N), pos.chunk(N))]
    want, ref = per_microbatch_reference(net, pieces, y.chunk(N), mse_mean)
    with RoundPipe(net, devices=DEVICES) as model:
        loss = model.forward_backward(
            input_kwargs=kw, label=y, loss_fn=mse_mean,
            run_config=RoundPipeRunConfig(num_microbatch=N,
                                          split_input=split_transformer_input))
        check(model, net, ref, loss, want)


def weighted(out, label):
    targets, weights = label
    return (((out - targets) ** 2) * weights).mean()


@pytest.mark.parametrize("form", ["both_chunked", "weights_replicated", "function"])
def test_split_label_specs_and_function(form):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4))
    x, targets = torch.randn(12, 8), torch.randn(12, 4)
    if form == "weights_replicated":
        weights = torch.rand(4)  # class weights, shared
        labels = [(t, weights) for t in targets.chunk(N)]
        spec = (TensorChunkSpec(0), _Replicate)
    else:
        weights = torch.rand(12, 1)  # sample weights
        labels = list(zip(targets.chunk(N), weights.chunk(N)))
        spec = (TensorChunkSpec(0), TensorChunkSpec(0))
    if form == "function":
        def spec(label, num_microbatch):
            targets, weights = label
            return [(t, w) for t, w in zip(targets.chunk(num_microbatch),
                                           weights.chunk(num_microbatch))]
    want, ref = per_microbatch_reference(net, [((p,), {}) for p in x.chunk(N)], labels,
                                         weighted)
    with RoundPipe(net, devices=DEVICES) as model:
        loss = model.forward_backward(
            input_args=(x,), label=(targets, weights), loss_fn=weighted,
            run_config=RoundPipeRunConfig(num_microbatch=N, split_label=spec))
        check(model, net, ref, loss, want)


def test_merge_output_specs_and_custom_function_on_a_model_output():
    torch.manual_seed(0)
    net = WithLogits()
    x = torch.randn(12, 8)
    with torch.no_grad():
        whole = [net(p) for p in x.chunk(N)]

    def custom_merge(outputs):
        return torch.cat([out.logits for out in outputs], dim=0)

    with RoundPipe(net, devices=DEVICES, model_run_config=RoundPipeRunConfig(
            num_microbatch=N)) as model, torch.no_grad():
        got = model(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=custom_merge))
        torch.testing.assert_close(got, torch.cat([w.logits for w in whole]), rtol=RTOL,
                                   atol=ATOL)
        got = model(x, roundpipe_run_config=RoundPipeRunConfig(
            merge_output=(TensorChunkSpec(0), TensorChunkSpec(0))))
        assert isinstance(got, Out)
        torch.testing.assert_close(got.hidden, torch.cat([w.hidden for w in whole]),
                                   rtol=RTOL, atol=ATOL)
        auto = model(x)
        assert isinstance(auto, Out)
        torch.testing.assert_close(auto.logits, got.logits, rtol=RTOL, atol=ATOL)
    # the page's reducer: sum the losses
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 1)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x).pow(2).mean()

    loss_net = Loss()
    with RoundPipe(loss_net, devices=DEVICES) as model, torch.no_grad():
        sum_reducer = _CustomReducer(torch.tensor(0.0), lambda x, y: x + y)
        got = model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=N,
                                                               merge_output=sum_reducer))
        want = sum(loss_net(p) for p in x.chunk(N))
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_bad_specs_raise_naming_the_argument():
    torch.manual_seed(0)
    net = Scaled()
    with RoundPipe(net, devices=DEVICES) as model, torch.no_grad():
        with pytest.raises(RoundPipeError, match="split_input"):
            model(torch.randn(6, 8), torch.randn(8), roundpipe_run_config=RoundPipeRunConfig(
                split_input=((TensorChunkSpec(0),), None)))  # one spec, two arguments
        with pytest.raises(RoundPipeError, match="split_input"):
            model(torch.randn(6, 8), torch.randn(8), roundpipe_run_config=RoundPipeRunConfig(
                split_input=((TensorChunkSpec(-1), _Replicate), None)))
        with pytest.raises(RoundPipeError, match="merge_output"):
            model(torch.randn(6, 8), 2.0, roundpipe_run_config=RoundPipeRunConfig(
                merge_output=object()))
