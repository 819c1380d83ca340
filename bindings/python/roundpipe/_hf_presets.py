"""Sequential presets for Hugging Face causal LMs the engine has no native layers for.

As upstream's presets do, a transformers model is rewritten as an nn.Sequential of its own
modules: an input adapter (embeddings, causal mask, rotary tables), one layer per decoder block,
an output adapter (final norm, LM head). Every layer is a Python layer running transformers'
code; the tuple (hidden states, mask, position ids, rotary tables) passes between them.

Two shapes are known: GPT-2 (``transformer.wte/wpe/h/ln_f``) and the Llama-like decoders of
transformers (``model.embed_tokens/layers/norm/rotary_emb``: Mixtral, Qwen2, Mistral, ...).
Weights tied across the adapters (GPT-2's ``lm_head`` and ``wte``) become two copies, each
trained by its own layer's gradient: tie_word_embeddings=False models train as transformers does.
"""

from typing import Any, Optional

from torch import nn


def _mask(config, embeds, attention_mask, position_ids):
    from transformers import masking_utils
    make = masking_utils.create_causal_mask
    if getattr(config, "sliding_window", None) is not None and \
            getattr(config, "use_sliding_window", True):
        make = getattr(masking_utils, "create_sliding_window_causal_mask", make)
    return make(config=config, inputs_embeds=embeds, attention_mask=attention_mask,
                past_key_values=None, position_ids=position_ids)


def _positions(embeds):
    import torch
    return torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)


class DecoderInput(nn.Module):
    """input_ids (, attention_mask) -> (hidden, mask, position ids, rotary tables)."""

    def __init__(self, config, embed_tokens, rotary_emb):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb

    def forward(self, input_ids: Any, attention_mask: Any = None, position_ids: Any = None,
                **_ignored: Any) -> Any:
        embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = _positions(embeds)
        mask = _mask(self.config, embeds, attention_mask, position_ids)
        return embeds, mask, position_ids, self.rotary_emb(embeds, position_ids=position_ids)


def _no_grad(value):
    """`value` (a tensor, a tuple of tensors or None) detached: the mask and the rotary tables
    come from positions, the attention mask and buffers, never from a trainable parameter, so
    they carry no gradient. Detached, the recompute neither computes their gradient (a
    reduction over heads and tokens per layer) nor passes one back through every block."""
    if isinstance(value, tuple):
        return tuple(_no_grad(v) for v in value)
    return value.detach() if hasattr(value, "detach") else value


class DecoderBlock(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, mask, position_ids, position_embeddings):
        mask, position_embeddings = _no_grad(mask), _no_grad(position_embeddings)
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                         position_embeddings=position_embeddings, use_cache=False)
        return (out[0] if isinstance(out, tuple) else out), mask, position_ids, \
            position_embeddings


class DecoderOutput(nn.Module):
    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden, *_rest):
        return self.lm_head(self.norm(hidden))


class GPT2Input(nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.config = transformer.config
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids, attention_mask=None, **_ignored):
        embeds = self.wte(input_ids)
        position_ids = _positions(embeds)
        hidden = self.drop(embeds + self.wpe(position_ids))
        return hidden, _mask(self.config, embeds, attention_mask, position_ids)


class GPT2Block(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden, mask):
        mask = _no_grad(mask)
        out = self.block(hidden, None, mask, use_cache=False)
        return (out[0] if isinstance(out, tuple) else out), mask


def peft_base_model(model: Any) -> Optional[nn.Module]:
    """The transformers model inside a PEFT model (``get_peft_model(...)``: its adapters
    injected into that model's modules), else None."""
    if type(model).__module__.split(".")[0] == "peft" and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return None


def sequential_preset(model: Any) -> Optional[nn.Sequential]:
    """An nn.Sequential of `model`'s own modules equivalent to its forward (logits), or None
    when `model` is not a causal LM of a known shape."""
    if not type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        return None
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    if head is not None and inner is not None and all(
            hasattr(inner, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return nn.Sequential(DecoderInput(model.config, inner.embed_tokens, inner.rotary_emb),
                             *[DecoderBlock(layer) for layer in inner.layers],
                             DecoderOutput(inner.norm, head))
    tr = getattr(model, "transformer", None)
    if head is not None and tr is not None and all(
            hasattr(tr, n) for n in ("wte", "wpe", "h", "ln_f", "drop")):
        return nn.Sequential(GPT2Input(tr), *[GPT2Block(b) for b in tr.h],
                             DecoderOutput(tr.ln_f, head))
    return None
