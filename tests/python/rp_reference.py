"""Plain-torch references for the binding tests: the same computation as the engine, written
independently from docs/semantics.md (no pipeline, no RoundPipe code)."""

import torch
from torch import nn

MASK64 = (1 << 64) - 1

# A small MLP: enough layers for two CPU devices to hold several stages each.
MLP_SPEC = {"layers": [
    {"type": "linear", "in": 8, "out": 16},
    {"type": "tanh"},
    {"type": "linear", "in": 16, "out": 16},
    {"type": "gelu"},
    {"type": "residual_mlp", "dim": 16, "hidden": 32},
    {"type": "linear", "in": 16, "out": 4},
]}


class ResidualMLP(nn.Module):
    """The engine's residual_mlp with its defaults: x + fc2(gelu(fc1(layer_norm(x))))."""

    def __init__(self, dim, hidden, eps=1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def torch_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(),
                         ResidualMLP(16, 32), nn.Linear(16, 4))


def torch_model_like(rp_model, module):
    """`module` with the RoundPipe model's current weights (same parameter names)."""
    state = rp_model.state_dict()
    module.load_state_dict(state, strict=True)
    return module


def microbatch_grads(module, x, y, n, loss_of):
    """Upstream's forward_backward semantics in plain torch: per microbatch (tensor_split
    along dim 0), loss, backward; returns the summed loss (float) and leaves the summed
    gradients in module's .grad."""
    total = 0.0
    for xm, ym in zip(torch.tensor_split(x, n), torch.tensor_split(y, n)):
        loss = loss_of(module(xm), ym)
        loss.backward()
        total += float(loss.detach().double())
    return total


def mix(x):
    """SplitMix64's finaliser (docs/semantics.md)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def dropout_mask(seed, call, layer, microbatch, shape, p):
    """The engine's dropout mask, from docs/semantics.md."""
    value = mix(mix(mix(mix(seed) ^ call) ^ layer) ^ microbatch)
    gen = torch.Generator().manual_seed(value)
    return torch.empty(shape).bernoulli_(1 - p, generator=gen)
