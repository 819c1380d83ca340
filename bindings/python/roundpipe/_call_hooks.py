"""What happens around every forward() / forward_backward() call, outside model.py: inputs that
are another model's packed outputs (merge_output=False) rewritten into a per-microbatch split, the
per-call execute_plan checked against the engine's plan, and the timer fed after the call."""

import functools
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import torch

from ._microbatch import (RoundPipePackedData, any_requiring_grad, chained_call,
                          packed_requiring_grad)
from .errors import RoundPipeUnsupportedError
from .execute_plan import check_call_plan
from .timer import ModelTimer

F = TypeVar("F", bound=Callable[..., Any])


def forward_call(method: F) -> F:
    """Wrap ``RoundPipe.forward(*args, roundpipe_run_config=None, **kwargs)``."""
    @functools.wraps(method)
    def forward(self: Any, *args: Any, roundpipe_run_config: Optional[Any] = None,
                **kwargs: Any) -> Any:
        self.handle  # raises when closed
        if torch.is_grad_enabled() and self.training and packed_requiring_grad(args, kwargs):
            raise RoundPipeUnsupportedError(
                "args / kwargs: a RoundPipePackedData input requires grad; packed inputs reach "
                "the engine through a split_input function, whose pieces it cannot put back "
                "together into input gradients, so backward would stop at this model; pass the "
                "first model's merged output (merge_output=True) to chain with gradients, or "
                "make the input under torch.no_grad() or with the first model in eval()")
        args, kwargs, config = chained_call(args, kwargs, roundpipe_run_config,
                                            self.model_run_config)
        check_call_plan(self, config, "infer")
        result = method(self, *args, roundpipe_run_config=config, **kwargs)
        ModelTimer.after_call(self)
        return result
    return forward  # type: ignore[return-value]


def forward_backward_call(method: F) -> F:
    """Wrap ``RoundPipe.forward_backward(input_args, input_kwargs, label, loss_fn,
    return_outputs, run_config)``."""
    @functools.wraps(method)
    def forward_backward(self: Any, input_args: Any = (),
                         input_kwargs: Optional[Dict[str, Any]] = None, label: Any = None,
                         loss_fn: Any = None, return_outputs: bool = False,
                         run_config: Optional[Any] = None) -> Any:
        self.handle  # raises when closed
        if isinstance(input_args, RoundPipePackedData) or \
                not isinstance(input_args, (tuple, list)):
            input_args = (input_args,)
        # Checked before anything runs: the call would otherwise train this model and leave
        # the inputs' producer (another model's training forward) silently without gradients.
        if any_requiring_grad(input_args, input_kwargs):
            raise RoundPipeUnsupportedError(
                "input_args / input_kwargs: an input requires grad (another model's training "
                "output, or a tensor made with requires_grad=True), and forward_backward() does "
                "not back-propagate into its inputs (the engine returns no input gradients), so "
                "whatever made it would get none; chain with this model's forward() and "
                "loss.backward() to train both, or make the input under torch.no_grad(), with "
                "the first model in eval(), or .detach() it to train this model alone")
        input_args, input_kwargs, config = chained_call(
            tuple(input_args), input_kwargs, run_config, self.model_run_config)
        check_call_plan(self, config, "fused")
        result = method(self, input_args, input_kwargs, label, loss_fn, return_outputs, config)
        ModelTimer.after_call(self)
        return result
    return forward_backward  # type: ignore[return-value]
