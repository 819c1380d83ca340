"""Microbatch split and output merge rules (upstream's, docs/semantics.md "Microbatches").

The model is one linear layer set to the identity, so every output row is the input row that
produced it and the tests can see exactly which rows each microbatch received. Values pass
through an exact identity product, so equality is exact.
"""

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402
from roundpipe import REPLICATE, RoundPipeError, RoundPipeRunConfig, Status  # noqa: E402

try:
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate
except ImportError:  # torch without distributed: the binding's own leaves are tested instead
    TensorChunkSpec = _CustomReducer = _Replicate = None

DEVICES = ("cpu", 2)
N_MB = 3


@pytest.fixture(scope="module")
def identity():
    spec = {"layers": [{"type": "linear", "in": 4, "out": 4}]}
    model = roundpipe.RoundPipe(spec, devices=DEVICES)
    model.load_state_dict({"0.weight": torch.eye(4), "0.bias": torch.zeros(4)})
    yield model
    model.close()


def rows(n, width=4, start=0):
    return torch.arange(start, start + n * width, dtype=torch.float32).reshape(n, width)


NO_MERGE = RoundPipeRunConfig(merge_output=False)


def test_inputs_split_along_dim0_with_tensor_split_sizes(identity):
    x = rows(7)
    pieces = identity(x, roundpipe_run_config=NO_MERGE)
    assert isinstance(pieces, roundpipe.RoundPipePackedData) and isinstance(pieces, list)
    assert pieces.synchronize() is pieces
    assert [p.shape[0] for p in pieces] == [3, 2, 2]  # larger pieces first
    for got, want in zip(pieces, torch.tensor_split(x, N_MB)):
        assert torch.equal(got, want)


def test_merged_output_concatenates_along_dim0(identity):
    x = rows(7)
    assert torch.equal(identity(x), x)
    assert torch.equal(identity.forward(x, roundpipe_run_config=RoundPipeRunConfig(
        num_microbatch=7)), x)


def test_per_call_num_microbatch_overrides_model_level():
    spec = {"layers": [{"type": "linear", "in": 4, "out": 4}]}
    with roundpipe.RoundPipe(spec, devices=DEVICES,
                             model_run_config=RoundPipeRunConfig(num_microbatch=2)) as model:
        x = rows(8)
        assert len(model(x, roundpipe_run_config=NO_MERGE)) == 2
        assert len(model(x, roundpipe_run_config=RoundPipeRunConfig(
            num_microbatch=4, merge_output=False))) == 4


def test_fewer_rows_than_microbatches_is_an_error(identity):
    with pytest.raises(RoundPipeError) as info:
        identity(rows(2))
    assert info.value.status == Status.INVALID_ARGUMENT
    assert info.value.message  # the engine says why
    assert torch.equal(identity(rows(3)), rows(3))  # still usable


def test_replicated_input_goes_whole_to_every_microbatch(identity):
    x = rows(2)  # fewer rows than microbatches: fine when replicated
    for spec in [(REPLICATE,), ((REPLICATE,), None)] + (
            [((_Replicate,), None)] if _Replicate else []):
        pieces = identity(x, roundpipe_run_config=RoundPipeRunConfig(split_input=spec,
                                                                     merge_output=False))
        assert len(pieces) == N_MB
        assert all(torch.equal(p, x) for p in pieces)
    merged = identity(x, roundpipe_run_config=RoundPipeRunConfig(split_input=(REPLICATE,)))
    assert torch.equal(merged, torch.cat([x] * N_MB))


def test_scalars_are_replicated_and_extra_inputs_travel_along(identity):
    x = rows(6)
    out = identity.forward(x, torch.tensor(2.0), 3.5, mask=torch.ones(6, 2))
    assert torch.equal(out, x)
    # a 0-d tensor cannot be split into 3 pieces: were it split, the call would fail
    loss, out = identity.forward_backward((x, torch.tensor(1.0)), {"flag": 7},
                                          loss_fn=lambda o, lab: o.sum(), return_outputs=True)
    assert torch.equal(out, x)
    assert float(loss) == pytest.approx(float(x.sum()))


@pytest.mark.skipif(TensorChunkSpec is None, reason="torch.distributed.pipelining missing")
def test_tensor_chunk_spec_splits_along_another_dim(identity):
    x = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    cfg = RoundPipeRunConfig(split_input=((TensorChunkSpec(1),), None), merge_output=False)
    pieces = identity(x, roundpipe_run_config=cfg)
    for got, want in zip(pieces, torch.tensor_split(x, N_MB, dim=1)):
        assert torch.equal(got, want)
    # default merge concatenates along dim 0; TensorChunkSpec(1) merges along dim 1
    assert identity(x, roundpipe_run_config=RoundPipeRunConfig(split_input=(1,))).shape == \
        (6, 2, 4)
    merged = identity(x, roundpipe_run_config=RoundPipeRunConfig(
        split_input=((TensorChunkSpec(1),), None), merge_output=TensorChunkSpec(1)))
    assert torch.equal(merged, x)


def test_custom_split_function(identity):
    x = rows(6)
    seen = []

    def reverse_split(args, kwargs, n):
        seen.append((len(args), sorted(kwargs), n))
        chunks = list(torch.tensor_split(args[0], n))[::-1]
        return [(c,) for c in chunks], [kwargs] * n

    out = identity(x, roundpipe_run_config=RoundPipeRunConfig(split_input=reverse_split))
    assert seen == [(1, [], N_MB)]
    assert torch.equal(out, torch.cat(list(torch.tensor_split(x, N_MB))[::-1]))


def test_custom_merge_function_and_reducer(identity):
    x = rows(6)
    out = identity(x, roundpipe_run_config=RoundPipeRunConfig(
        merge_output=lambda outs: [o.shape[0] for o in outs]))
    assert out == [2, 2, 2]
    if _CustomReducer is not None:
        total = identity(x, roundpipe_run_config=RoundPipeRunConfig(
            merge_output=_CustomReducer(torch.tensor(0.0), lambda a, b: a + b.sum())))
        assert float(total) == float(x.sum())


def test_labels_split_like_the_inputs(identity):
    x = rows(7)
    got = []

    def loss_fn(out, label):
        got.append((out.clone(), label))
        return out.sum() * 0

    identity.forward_backward((x,), label=x.clone(), loss_fn=loss_fn)
    assert len(got) == N_MB
    for out, label in got:
        assert torch.equal(out, label)  # the label rows belong to the output rows
    assert sorted(out.shape[0] for out, _ in got) == [2, 2, 3]


def test_nested_labels_split_leaf_by_leaf_and_replicate_scalars(identity):
    x = rows(6)
    weights = torch.arange(6.0)
    got = {}

    def loss_fn(out, label):
        target, extra = label
        m = int(out[0, 0].item()) // 8  # identity: first row value tells the microbatch
        got[m] = (target, extra)
        return (out - target).pow(2).sum()

    label = (x, {"w": weights, "scale": torch.tensor(2.0), "tag": "t"})
    loss = identity.forward_backward((x,), label=label, loss_fn=loss_fn)
    assert float(loss) == 0.0
    assert sorted(got) == [0, 1, 2]
    for m, (target, extra) in got.items():
        assert torch.equal(target, x[2 * m:2 * m + 2])
        assert torch.equal(extra["w"], weights[2 * m:2 * m + 2])
        assert float(extra["scale"]) == 2.0 and extra["tag"] == "t"
    identity.zero_grad()


def test_label_split_specs_and_functions(identity):
    x = rows(6)
    labels = []
    fn = lambda out, label: (labels.append(label), out.sum() * 0)[1]  # noqa: E731
    identity.forward_backward((x,), label=x, loss_fn=fn,
                              run_config=RoundPipeRunConfig(split_label=REPLICATE))
    assert len(labels) == N_MB and all(torch.equal(lab, x) for lab in labels)
    labels.clear()
    identity.forward_backward((x,), label=x, loss_fn=fn, run_config=RoundPipeRunConfig(
        split_label=lambda label, n: [label[:1]] * n))
    assert all(torch.equal(lab, x[:1]) for lab in labels)
    identity.zero_grad()


def test_builtin_loss_label_split_dim():
    """The engine splits the labels of a built-in loss: dim 0 by default; another dim when
    asked (here outputs [B, T, 4] split along dim 1, labels too)."""
    spec = {"layers": [{"type": "linear", "in": 4, "out": 4}]}
    with roundpipe.RoundPipe(spec, devices=DEVICES) as model:
        model.load_state_dict({"0.weight": torch.eye(4), "0.bias": torch.zeros(4)})
        x = torch.randn(2, 6, 4)
        y = torch.randn(2, 6, 4)
        want = sum(float(torch.nn.functional.mse_loss(a, b))
                   for a, b in zip(torch.tensor_split(x, N_MB, 1), torch.tensor_split(y, N_MB, 1)))
        loss = model.forward_backward((x,), label=y, loss_fn="mse", run_config=RoundPipeRunConfig(
            split_input=(1,), split_label=1))
        assert float(loss) == pytest.approx(want, rel=1e-5)


def test_output_loss_is_the_default_and_sums_over_microbatches():
    spec = {"layers": [{"type": "linear", "in": 4, "out": 1}]}
    with roundpipe.RoundPipe(spec, devices=DEVICES) as model:
        x = torch.randn(3, 4)  # one row per microbatch: each output holds one element
        loss = model.forward_backward((x,))
        model.synchronize()
        state = model.state_dict()
        want = (x @ state["0.weight"].T + state["0.bias"]).sum()
        assert float(loss) == pytest.approx(float(want), rel=1e-5)
        grads = dict(model.named_parameters())
        torch.testing.assert_close(grads["0.weight"].grad, x.sum(0, keepdim=True))
        torch.testing.assert_close(grads["0.bias"].grad, torch.tensor([3.0]))
