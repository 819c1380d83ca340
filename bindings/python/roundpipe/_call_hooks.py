"""What happens around every forward() / forward_backward() call, outside model.py: inputs that
are another model's packed outputs (merge_output=False) rewritten into a per-microbatch split, the
per-call execute_plan checked against the engine's plan, and the timer fed after the call."""

import functools
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import torch

from ._chained_backward import forward_backward_through_forward
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
        # The fused call gives no input gradients: inputs that require grad (another model's
        # training output) take forward() and loss.backward(), as upstream back-propagates.
        if any_requiring_grad(input_args, input_kwargs):
            return forward_backward_through_forward(self, input_args, input_kwargs, label,
                                                    loss_fn, return_outputs, run_config)
        input_args, input_kwargs, config = chained_call(
            tuple(input_args), input_kwargs, run_config, self.model_run_config)
        check_call_plan(self, config, "fused")
        result = method(self, input_args, input_kwargs, label, loss_fn, return_outputs, config)
        ModelTimer.after_call(self)
        return result
    return forward_backward  # type: ignore[return-value]
