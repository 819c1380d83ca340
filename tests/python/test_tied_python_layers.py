"""Tied weights across Python layers (an embedding and an LM head sharing one nn.Parameter): the
engine keeps one parameter whose gradient sums both uses, and training matches plain torch.
Tolerance: fp32, relative 1e-5 plus an absolute 1e-6 floor (same kernels, different summation
order across microbatches and stages)."""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import roundpipe  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


class Embed(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, ids):
        return nn.functional.embedding(ids, self.table)


class Head(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, h):
        return h @ self.table.t()


def tied_model():
    torch.manual_seed(3)
    table = nn.Parameter(torch.randn(11, 8) * 0.5)
    return nn.Sequential(Embed(table), nn.Linear(8, 8), nn.Tanh(), Head(table))


def test_tied_parameter_is_one_engine_parameter_and_trains_like_torch():
    module, reference = tied_model(), tied_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ids = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(1))

    def loss_fn(logits, target):
        return nn.functional.cross_entropy(logits.reshape(-1, 11), target.reshape(-1)) / 3

    with roundpipe.RoundPipe(module, devices=("cpu", 2)) as model:
        for step in range(3):
            loss = model.forward_backward((ids,), label=labels, loss_fn=loss_fn)
            ref = sum(loss_fn(reference(i), t) for i, t in
                      zip(torch.tensor_split(ids, 3), torch.tensor_split(labels, 3)))
            ref.backward()
            assert abs(float(loss) - ref.item()) <= 1e-5 * abs(ref.item()) + 1e-6
            model.step(roundpipe.optim.SGD(lr=0.5), is_async=False)
            model.zero_grad()
            opt.step()
            opt.zero_grad()
        model.synchronize()
        assert module[0].table is module[3].table
        torch.testing.assert_close(module[0].table.detach(), reference[0].table.detach(), **TOL)
        torch.testing.assert_close(module[1].weight.detach(), reference[1].weight.detach(), **TOL)
