"""forward_backward() on inputs that require grad: another model's training output (upstream's
"model1.forward(...) then model2.forward_backward(input_args=(output1,))"), or a tensor made
with requires_grad=True. Upstream back-propagates into such inputs; the fused call cannot (the
engine's rp_forward_backward returns no input gradients). So the call runs as upstream's
non-fused training instead: this model's training forward() with one output per microbatch,
the loss of each microbatch in Python, and one backward through the sum, which gives this
model its gradients (rp_backward) and the inputs theirs (rp_backward_input_grads), from where
autograd carries them into whatever made the inputs. Slower than the fused call (the pipeline
runs forward and backward as two passes), which is why it is taken only for such inputs.
"""

from typing import Any, Optional

import torch

from ._args import builtin_loss
from ._microbatch import RoundPipePackedData, _select, merge_default, split_label
from ._pytree import flatten
from .config import RoundPipeRunConfig
from .errors import RoundPipeUnsupportedError


def _microbatches(outputs: Any) -> int:
    """How many microbatches a merge_output=False result holds (its packed leaves' length)."""
    if isinstance(outputs, RoundPipePackedData):
        return len(outputs)
    children = outputs.values() if isinstance(outputs, dict) else \
        outputs if isinstance(outputs, (tuple, list)) else ()
    for child in children:
        n = _microbatches(child)
        if n:
            return n
    return 0


def forward_backward_through_forward(model: Any, input_args: Any, input_kwargs: Any,
                                     label: Any, loss_fn: Any, return_outputs: bool,
                                     run_config: Optional[RoundPipeRunConfig]) -> Any:
    """RoundPipe.forward_backward's result (the loss sum as a 0-d float64 tensor, with the
    merged outputs when `return_outputs`), computed through forward() and loss.backward()."""
    builtin = builtin_loss(loss_fn, label, return_outputs)
    if builtin is not None and builtin.kind != "output":
        raise RoundPipeUnsupportedError(
            "loss_fn=%r with inputs that require grad: back-propagating into the inputs takes "
            "forward() and backward in Python, where the built-in losses are not computed; "
            "pass a Python loss_fn (e.g. torch.nn.functional.mse_loss with reduction='sum')"
            % (builtin.kind,))
    if not model.training:
        raise RoundPipeUnsupportedError(
            "forward_backward() with inputs that require grad runs as forward() and "
            "loss.backward(), which trains only in training mode: call train() first, or "
            "detach the inputs")
    fields = {f: getattr(run_config, f) for f in RoundPipeRunConfig._FIELDS} \
        if run_config is not None else {}
    fields.update(merge_output=False, requires_grad=True)
    outputs = model.forward(*input_args, roundpipe_run_config=RoundPipeRunConfig(**fields),
                            **dict(input_kwargs or {}))
    n = _microbatches(outputs)
    per_microbatch = [_select(outputs, m, n, None) for m in range(n)]
    labels = [None] * n if label is None else \
        split_label(label, model._run_config.call_fields(run_config).split_label, n)
    scale = builtin.scale if builtin is not None else 1.0  # BuiltinLoss("output", scale)
    fn = model._steps.wrap_loss(loss_fn if builtin is None else lambda out, _: out * scale)
    total = None
    for out, lab in zip(per_microbatch, labels):
        loss = fn(out, lab)
        parts = loss if isinstance(loss, (tuple, list)) else (loss,)
        for part in parts:
            total = part.sum() if total is None else total + part.sum()
    total.backward()
    value = total.detach().to(device="cpu", dtype=torch.float64)
    if not return_outputs:
        return value
    detached = []
    for v in per_microbatch:
        tensors, spec = flatten(v)
        detached.append(spec.unflatten([t.detach() for t in tensors]))
    return value, merge_default(detached)
