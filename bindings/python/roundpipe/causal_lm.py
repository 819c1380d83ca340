"""Hugging Face causal LMs that look like their transformers forms.

A RoundPipe of a causal LM (the engine's native Qwen3 / Qwen3-MoE / Llama, or a Python Sequential preset of
a transformers model, PEFT LoRA models included) computes logits. Through :class:`CausalLM`
the binding gives them the shape transformers users expect, as upstream's presets do:

- ``forward()`` returns a ``CausalLMOutputWithPast`` (transformers' own class when transformers
  is importable, else :class:`CausalLMOutput`, which reads the same) with ``.logits``, and
  ``.loss`` when ``labels=`` is given: transformers' loss over the whole batch (the model's
  ``loss_function``: token t scored against label t + 1, -100 for no target).
  ``return_logits=False`` (upstream's) leaves ``.logits`` None; ``logits_to_keep=n``
  keeps the last n positions, as transformers does.
- ``forward_backward()``: ``labels`` in ``input_kwargs`` gives every microbatch the model's own
  loss (``outputs.loss``, transformers' loss of that microbatch), which is the loss when
  ``loss_fn`` is None (upstream: the microbatch losses are summed); a Python ``loss_fn``
  receives the output object (``outputs.logits``, ``outputs.loss``) and ``label``.
  A Python ``loss_fn`` returning an output object trains on its non-None tensors, as
  upstream's "sequence of loss tensors".
- custom merge functions (``merge_output=fn``) receive the per-microbatch output objects.
- ``generate()`` (:func:`generate`): greedy or sampled decoding, one full forward per new
  token (no KV cache).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .errors import RoundPipeUnsupportedError

__all__ = ["CausalLMOutput", "CausalLM", "make_causal_lm_output", "causal_lm_loss",
           "generate"]

IGNORE_INDEX = -100

# Keywords of a transformers causal LM's forward that carry nothing here (no KV cache, outputs
# always returned as an object): accepted and dropped when they ask for nothing.
_IGNORED_KWARGS = ("use_cache", "return_dict", "cache_position", "past_key_values",
                   "output_attentions", "output_hidden_states")


class CausalLMOutput(dict):
    """Stand-in for transformers' ``CausalLMOutputWithPast`` when transformers is not
    installed: ``loss``, ``logits`` (attributes and keys), ``past_key_values``,
    ``hidden_states`` and ``attentions`` (always None); indexing by int and ``to_tuple()`` see
    the non-None fields in that order, as transformers' ModelOutput does."""

    _FIELDS = ("loss", "logits", "past_key_values", "hidden_states", "attentions")

    def __init__(self, loss: Optional[torch.Tensor] = None, logits: Any = None,
                 past_key_values: Any = None, hidden_states: Any = None,
                 attentions: Any = None) -> None:
        super().__init__()
        values = (loss, logits, past_key_values, hidden_states, attentions)
        for name, value in zip(self._FIELDS, values):
            object.__setattr__(self, name, value)
            if value is not None:
                dict.__setitem__(self, name, value)

    def __getitem__(self, key: Union[str, int, slice]) -> Any:
        if isinstance(key, str):
            return dict.__getitem__(self, key)
        return self.to_tuple()[key]

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in self._FIELDS:
            if value is None:
                self.pop(name, None)
            else:
                dict.__setitem__(self, name, value)

    def to_tuple(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS
                     if getattr(self, name) is not None)


def _output_class() -> type:
    try:
        from transformers.modeling_outputs import CausalLMOutputWithPast
    except Exception:  # noqa: BLE001 - transformers missing or broken: our stand-in
        return CausalLMOutput
    return CausalLMOutputWithPast


def make_causal_lm_output(logits: Any = None, loss: Optional[torch.Tensor] = None) -> Any:
    """A ``CausalLMOutputWithPast`` (or :class:`CausalLMOutput`) of `logits` and `loss`."""
    return _output_class()(loss=loss, logits=logits)


def is_model_output(value: Any) -> bool:
    """A transformers ModelOutput or a :class:`CausalLMOutput`."""
    return isinstance(value, CausalLMOutput) or (
        isinstance(value, dict) and hasattr(value, "to_tuple")
        and type(value).__module__.startswith("transformers"))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None,
                   num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
                   ignore_index: int = IGNORE_INDEX, **_ignored: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``: the mean cross entropy (in fp32) of token t against
    label t + 1 over the targets (labels other than `ignore_index`), or their sum over
    `num_items_in_batch` when given."""
    logits = logits.float()
    labels = labels.to(logits.device)
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)
    flat = logits.reshape(-1, vocab_size or logits.shape[-1])
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(flat, shifted, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def count_targets(labels: torch.Tensor) -> int:
    """Targets of a batch of causal-LM labels: labels after the first position that are not
    -100 (each scores the token before it)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


class _LossCall:
    """The Python loss_fn the engine calls per microbatch for a causal LM: builds the output
    object (model loss from the microbatch's labels when given) and calls the user's loss_fn on
    it, or returns the model's loss."""

    def __init__(self, causal: "CausalLM", user_fn: Optional[Callable[..., Any]],
                 with_labels: bool, return_logits: bool, num_items: Optional[int]) -> None:
        self.causal = causal
        self.user_fn = user_fn
        self.with_labels = with_labels
        self.return_logits = return_logits
        self.num_items = num_items
        self.model_losses: List[torch.Tensor] = []
        self._lock = threading.Lock()

    def __call__(self, logits: torch.Tensor, label: Any) -> Any:
        user_label, model_labels = label if self.with_labels else (label, None)
        loss = None
        if model_labels is not None:
            loss = self.causal.loss(logits, model_labels, num_items_in_batch=self.num_items)
            with self._lock:
                self.model_losses.append(loss.detach().double().cpu())
        if self.user_fn is None:
            if loss is None:
                raise RoundPipeUnsupportedError(
                    "forward_backward of a causal LM without loss_fn needs labels: "
                    "label=... or input_kwargs={'labels': ...}")
            return loss
        output = make_causal_lm_output(logits if self.return_logits else None, loss)
        result = self.user_fn(output, user_label)
        if is_model_output(result):  # upstream: a sequence of loss tensors
            result = [v for v in result.to_tuple() if isinstance(v, torch.Tensor)]
        return result

    def model_loss(self) -> Optional[torch.Tensor]:
        if not self.model_losses:
            return None
        return torch.stack(self.model_losses).sum()


class CausalLM:
    """What makes a RoundPipe of a causal LM behave as its transformers form (see the module
    docstring). `original`: the user's model (its ``loss_function``, ``generation_config`` and
    ``config`` are used when present); `vocab_size`; `native`: the engine's own layers (its
    fused ``causal_lm`` loss is the default for ``label=``)."""

    def __init__(self, original: Any = None, vocab_size: Optional[int] = None,
                 native: bool = False, config: Optional[Dict[str, Any]] = None) -> None:
        self.original = original
        self.native = native
        self.config = config or {}
        if vocab_size is None:
            cfg = getattr(original, "config", None)
            vocab_size = getattr(cfg, "vocab_size", None) or self.config.get("vocab_size")
        self.vocab_size = vocab_size

    @classmethod
    def of_transformers(cls, model: Any) -> Optional["CausalLM"]:
        """The CausalLM of a transformers (or PEFT) causal LM object, else None."""
        names = [c.__name__ for c in type(model).__mro__]
        if not any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names):
            return None
        return cls(model)

    # -- loss ---------------------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, labels: torch.Tensor,
             num_items_in_batch: Optional[int] = None) -> torch.Tensor:
        """The model's loss (its ``loss_function`` when it has one, else transformers'
        ForCausalLMLoss) of `logits` against `labels`."""
        fn = getattr(self.original, "loss_function", None) if self.original is not None \
            else None
        if not callable(fn):
            fn = causal_lm_loss
        kwargs = {"vocab_size": self.vocab_size or logits.shape[-1]}
        if num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        return fn(logits=logits, labels=labels.to(logits.device), **kwargs)

    # -- forward ------------------------------------------------------------------------------

    @staticmethod
    def _pop(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], Any, bool, int]:
        """(kwargs for the model, labels, return_logits, logits_to_keep)."""
        kwargs = dict(kwargs or {})
        labels = kwargs.pop("labels", None)
        return_logits = kwargs.pop("return_logits", True)
        keep = kwargs.pop("logits_to_keep", kwargs.pop("num_logits_to_keep", 0))
        for name in _IGNORED_KWARGS:
            value = kwargs.pop(name, None)
            if name in ("output_attentions", "output_hidden_states") and value:
                raise RoundPipeUnsupportedError(
                    "%s=True: a RoundPipe causal LM returns logits and loss only" % name)
            if name == "past_key_values" and value is not None and \
                    not _empty_cache(value):
                raise RoundPipeUnsupportedError(
                    "past_key_values: RoundPipe has no KV cache; pass the whole sequence")
        if kwargs.get("inputs_embeds") is not None:
            raise RoundPipeUnsupportedError("inputs_embeds: a RoundPipe causal LM takes "
                                            "input_ids")
        kwargs.pop("inputs_embeds", None)
        if isinstance(keep, torch.Tensor):
            raise RoundPipeUnsupportedError("logits_to_keep as a tensor of indices")
        return kwargs, labels, bool(return_logits), int(keep or 0)

    def forward_call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                     ) -> Tuple[Tuple[Any, ...], Dict[str, Any], Callable[[Any], Any]]:
        """(args, kwargs for the engine, finish(result) -> the output object) of forward()."""
        kwargs, labels, return_logits, keep = self._pop(kwargs)

        def finish(result: Any) -> Any:
            if not isinstance(result, torch.Tensor):  # per microbatch (merge_output=False)
                return make_causal_lm_output(result if return_logits else None)
            logits = result
            loss = self.loss(logits, labels) if labels is not None else None
            if keep:
                logits = logits[:, -keep:]
            return make_causal_lm_output(logits if return_logits else None, loss)

        return tuple(args), kwargs, finish

    # -- training -----------------------------------------------------------------------------

    def training_call(self, input_args: Any, input_kwargs: Optional[Dict[str, Any]],
                      label: Any, loss_fn: Any, return_outputs: bool
                      ) -> Tuple[Any, Dict[str, Any], Any, Any, Callable[[Any], Any]]:
        """(input_args, input_kwargs, label, loss_fn, finish) of a forward_backward: labels in
        input_kwargs become the model's loss per microbatch; a Python loss_fn gets the output
        object; a label without loss_fn on a Python preset gets the model's loss over the
        batch's targets (the native engine's built-in "causal_lm" does the same)."""
        kwargs, labels, return_logits, _keep = self._pop(input_kwargs)
        user_fn = loss_fn if callable(loss_fn) and not isinstance(loss_fn, str) else None
        call = None
        if labels is not None:  # the model's own loss, per microbatch
            if user_fn is None and loss_fn is not None:
                raise RoundPipeUnsupportedError(
                    "labels in input_kwargs give the model's own loss: loss_fn must be None "
                    "or a Python callable, not %r" % (loss_fn,))
            call = _LossCall(self, user_fn, True, return_logits, None)
            label = (label, labels)
        elif user_fn is not None:  # the user's loss on the output object
            call = _LossCall(self, user_fn, False, return_logits, None)
        elif loss_fn is None and label is not None and not self.native:
            # a Python preset given label=: the model's loss over the batch's targets, as the
            # native engine's built-in "causal_lm"
            if not isinstance(label, torch.Tensor):
                raise TypeError("label of a causal LM must be a tensor of token ids")
            call = _LossCall(self, None, True, return_logits, count_targets(label))
            label = (None, label)

        def finish(outputs: Any) -> Any:
            outputs = self.wrap_output(outputs)
            if is_model_output(outputs):
                if not return_logits:
                    outputs.logits = None
                model_loss = call.model_loss() if call is not None else None
                if getattr(outputs, "loss", None) is None and model_loss is not None:
                    outputs.loss = model_loss
            return outputs

        return input_args, kwargs, label, call if call is not None else loss_fn, finish

    # -- merges -------------------------------------------------------------------------------

    @staticmethod
    def merge_function(custom: Any) -> Any:
        """A custom merge function sees the per-microbatch output objects (upstream's
        ``torch.cat([out.logits for out in outputs])``); reducers and chunk specs are kept."""
        if custom is None or not callable(custom) or hasattr(custom, "reduce_fn") or \
                hasattr(custom, "split_dim"):
            return custom

        def merge(outputs: Sequence[Any]) -> Any:
            return custom([o if is_model_output(o) else make_causal_lm_output(o)
                           for o in outputs])

        return merge

    def wrap_output(self, result: Any) -> Any:
        """A merged result of forward_backward(return_outputs=True) as the output object."""
        if isinstance(result, torch.Tensor) or hasattr(result, "synchronize"):
            return make_causal_lm_output(result)
        return result


def _empty_cache(value: Any) -> bool:
    try:
        return len(value) == 0
    except TypeError:
        return getattr(value, "get_seq_length", lambda: 1)() == 0


def _generation_setting(model: Any, name: str, given: Any) -> Any:
    if given is not None:
        return given
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, name, None) if source is not None else None
        if value is not None:
            return value
    return None


@torch.no_grad()
def generate(model: Any, input_ids: Optional[torch.Tensor] = None,
             attention_mask: Optional[torch.Tensor] = None,
             max_new_tokens: Optional[int] = None, max_length: Optional[int] = None,
             do_sample: Optional[bool] = None, temperature: Optional[float] = None,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_token_id: Optional[Union[int, Sequence[int]]] = None,
             pad_token_id: Optional[int] = None, generator: Optional[torch.Generator] = None,
             **kwargs: Any) -> torch.Tensor:
    """Generate tokens with a RoundPipe causal LM, as transformers' ``generate()`` does for
    greedy (default) or sampled decoding, one whole forward pass per new token (RoundPipe has no
    KV cache: slow, for short prompts). Returns the prompt followed by the new tokens
    ([batch, length]); a sequence that produced an end token is padded with `pad_token_id`.
    Settings not given come from the model's ``generation_config`` / ``config``
    (``max_new_tokens`` 20 when neither says). Left-padded batches need `attention_mask`."""
    from .config import RoundPipeRunConfig
    if input_ids is None:
        input_ids = kwargs.pop("inputs", None)
    if input_ids is None:
        raise TypeError("generate() needs input_ids")
    unsupported = {k: v for k, v in kwargs.items()
                   if k not in ("use_cache", "generation_config", "return_dict_in_generate",
                                "num_beams", "num_return_sequences")}
    if unsupported:
        raise RoundPipeUnsupportedError("generate(): unsupported arguments %s"
                                        % ", ".join(sorted(unsupported)))
    if kwargs.get("return_dict_in_generate") or (kwargs.get("num_beams") or 1) > 1 or \
            (kwargs.get("num_return_sequences") or 1) > 1:
        raise RoundPipeUnsupportedError("generate(): greedy or sampled decoding of one "
                                        "sequence per prompt only")
    if max_new_tokens is None and max_length is None:
        max_new_tokens = _generation_setting(model, "max_new_tokens", None)
        if max_new_tokens is None:
            max_length = _generation_setting(model, "max_length", None) or 20
    if max_new_tokens is None:
        max_new_tokens = max(0, max_length - input_ids.shape[-1])
    do_sample = bool(_generation_setting(model, "do_sample", do_sample))
    eos = _generation_setting(model, "eos_token_id", eos_token_id)
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = _generation_setting(model, "pad_token_id", pad_token_id)
    if pad is None and eos:
        pad = eos[0]
    ids = input_ids.to(torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(torch.long)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    config = RoundPipeRunConfig(num_microbatch=1)
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        for _ in range(max_new_tokens):
            inputs = {"input_ids": ids, "attention_mask": mask}
            if not bool(mask.all()):  # left padding: positions count the real tokens only
                inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(**inputs, roundpipe_run_config=config).logits[:, -1, :].float()
            if do_sample:
                next_id = _sample(logits, temperature, top_k, top_p, generator)
            else:
                next_id = logits.argmax(dim=-1)
            next_id = next_id.cpu()
            if pad is not None:
                next_id = torch.where(done, torch.full_like(next_id, pad), next_id)
            ids = torch.cat([ids, next_id[:, None]], dim=-1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            if eos:
                done = done | torch.isin(next_id, torch.tensor(eos))
                if bool(done.all()):
                    break
    finally:
        model.train(was_training)
    return ids


def _sample(logits: torch.Tensor, temperature: Optional[float], top_k: Optional[int],
            top_p: Optional[float], generator: Optional[torch.Generator]) -> torch.Tensor:
    if temperature is not None and temperature > 0:
        logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# -- RoundPipe methods of a causal LM (model.py decorates forward and forward_backward) --------

def _merge_config(rp: Any, causal: CausalLM, run_config: Any) -> Tuple[Any, bool]:
    """(`run_config` with a custom merge function (the call's or the model's) wrapped to see the
    output objects, whether such a function merges: its result is the call's, as it is)."""
    import copy

    merge = getattr(run_config, "merge_output", None) if run_config is not None else None
    if merge is None:
        merge = getattr(rp.__dict__.get("_run_config"), "merge_output", None)
    wrapped = causal.merge_function(merge)
    if wrapped is merge:
        return run_config, False
    if run_config is None:
        from .config import RoundPipeRunConfig
        run_config = RoundPipeRunConfig()
    else:
        run_config = copy.copy(run_config)
    run_config.merge_output = wrapped
    return run_config, True


def causal_lm_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """RoundPipe.forward of a causal LM: labels / return_logits / transformers keywords taken
    off the engine's inputs, the result as a CausalLMOutputWithPast (see :class:`CausalLM`)."""
    import functools

    @functools.wraps(forward)
    def wrapper(self: Any, *args: Any, roundpipe_run_config: Any = None, **kwargs: Any) -> Any:
        causal = self.__dict__.get("_causal_lm")
        if causal is None:
            return forward(self, *args, roundpipe_run_config=roundpipe_run_config, **kwargs)
        args, kwargs, finish = causal.forward_call(args, kwargs)
        config, custom = _merge_config(self, causal, roundpipe_run_config)
        result = forward(self, *args, roundpipe_run_config=config, **kwargs)
        return result if custom else finish(result)

    return wrapper


def causal_lm_forward_backward(forward_backward: Callable[..., Any]) -> Callable[..., Any]:
    """RoundPipe.forward_backward of a causal LM: labels in input_kwargs give the model's own
    loss, a Python loss_fn receives the output object, return_outputs gives one (see
    :class:`CausalLM`)."""
    import functools

    @functools.wraps(forward_backward)
    def wrapper(self: Any, input_args: Any = (), input_kwargs: Optional[Dict[str, Any]] = None,
                label: Any = None, loss_fn: Any = None, return_outputs: bool = False,
                run_config: Any = None) -> Any:
        causal = self.__dict__.get("_causal_lm")
        if causal is None:
            return forward_backward(self, input_args, input_kwargs, label, loss_fn,
                                    return_outputs, run_config)
        input_args, input_kwargs, label, loss_fn, finish = causal.training_call(
            input_args, input_kwargs, label, loss_fn, return_outputs)
        config, custom = _merge_config(self, causal, run_config)
        result = forward_backward(self, input_args, input_kwargs, label, loss_fn,
                                  return_outputs, config)
        if return_outputs:
            value, outputs = result
            return value, outputs if custom else finish(outputs)
        return result

    return wrapper
