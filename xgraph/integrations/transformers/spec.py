"""What xgraph needs to know about a transformers model, and the models it refuses.

`inspect_model` reads the model's config once, before anything is allocated: the layer
count, heads, head size, dtype and vocabulary size the paged KV cache and the executor's
inputs are built from. Everything the paged runners cannot reproduce exactly is refused
here, with the model's name and the reason, rather than producing wrong logits later:

- attention that does not go through transformers' AttentionInterface (nothing to route);
- encoder-decoder and composite (multimodal) models: xgraph runs one causal text decoder;
- layers that are not softmax attention (linear attention, state-space layers, chunked
  attention): the paged cache holds keys and values only;
- attention layers that differ in shape (per-layer head counts) or keys and values of
  different sizes (multi-head latent attention): one cache layout serves every layer;
- logit soft-capping inside attention: the runners compute plain scaled softmax;
- sliding-window layers whose window is shorter than the longest sequence the cache
  allows (`ModelSpec.check_context`): within the window they are exact, past it not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import UnsupportedModelError

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class ModelSpec:
    """The attention layout of a decoder, as the paged cache and the executor see it."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int | None  # max_position_embeddings, when the config has one
    dtype: torch.dtype
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    def refuse(self, reason: str, hint: str = "") -> UnsupportedModelError:
        return UnsupportedModelError(self.name, reason, hint)

    def check_context(self, max_model_len: int) -> None:
        """Refuse sliding-window layers whose window a sequence of max_model_len could pass.

        A query attends to keys less than `window` positions behind it; while every
        sequence is at most `window` long, that is every earlier key, which is exactly what
        the paged runners compute."""
        if self.sliding_layers and self.sliding_window is not None:
            if max_model_len > self.sliding_window:
                raise self.refuse(
                    f"layers {_short(self.sliding_layers)} use sliding-window attention "
                    f"(window {self.sliding_window} tokens) and xgraph's paged runners attend "
                    f"over the whole context, so sequences longer than the window "
                    f"(max_model_len={max_model_len}) would get different logits",
                    f"Build it with max_model_len <= {self.sliding_window}: the window then "
                    "never cuts a sequence and these layers are exact.",
                )


def _short(layers: Sequence[int]) -> str:
    items = list(layers)
    return str(items) if len(items) <= 8 else f"{items[:8]}... ({len(items)} layers)"


def model_name(model: Any) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    return f"{type(model).__name__} (model_type {model_type!r})"


def _check_kind(model: Any, name: str) -> None:
    """A causal text decoder whose attention goes through the AttentionInterface."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            name,
            "it is an encoder-decoder model; xgraph runs causal "
            "decoders (every attention layer causal self-attention)",
        )
    if getattr(config, "sub_configs", None):
        raise UnsupportedModelError(
            name,
            f"it is a composite model (sub-configs {sorted(config.sub_configs)})",
            "Load its text decoder on its own (the *ForCausalLM class of the text config).",
        )
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):
        raise UnsupportedModelError(
            name,
            "it is not a causal language model (no LM head to generate with)",
            "Load it with AutoModelForCausalLM.",
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            name,
            "its attention does not go through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so xgraph cannot route it to the paged "
            "KV cache",
        )


def _check_layers(config: Any, name: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the sliding layers; refuse layers that are not attention."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        other = sorted(set(types) - {FULL, SLIDING})
        if other:
            raise UnsupportedModelError(
                name,
                f"it has layers of type {other}; xgraph's paged cache holds the keys and "
                "values of softmax attention only",
            )
        sliding = tuple(i for i, t in enumerate(types) if t == SLIDING)
    else:  # Mistral-style configs: a window in the config applies to every layer
        sliding = tuple(range(num_layers)) if window else ()
    if sliding and not window:
        raise UnsupportedModelError(
            name,
            f"layers {_short(sliding)} are sliding-window layers "
            "but the config gives no sliding_window",
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            name,
            "its attention soft-caps the logits (attn_logit_softcapping); xgraph's "
            "runners compute plain scaled softmax",
        )
    return (window if sliding else None), sliding


def _heads(config: Any, name: str) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim), one value for every layer."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for field_name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int):
            raise UnsupportedModelError(
                name,
                f"its attention layers differ ({field_name} is {value!r}, not one number)",
                "xgraph allocates one cache layout for every layer.",
            )
    if getattr(config, "kv_lora_rank", None) is not None:
        raise UnsupportedModelError(
            name,
            "it uses multi-head latent attention (kv_lora_rank): keys and values have "
            "different sizes, and the paged cache stores both at one head dim",
        )
    return heads, kv, head_dim


def inspect_model(model: Any) -> ModelSpec:
    """The model's ModelSpec, or UnsupportedModelError naming the model and the reason."""
    name = model_name(model)
    _check_kind(model, name)
    config = model.config
    num_layers = config.num_hidden_layers
    window, sliding = _check_layers(config, name, num_layers)
    heads, kv, head_dim = _heads(config, name)
    param = next(model.parameters(), None)
    return ModelSpec(
        name=name,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_position=getattr(config, "max_position_embeddings", None),
        dtype=param.dtype if param is not None else torch.float32,
        sliding_window=window,
        sliding_layers=sliding,
    )
