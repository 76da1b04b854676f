"""What xgraph needs to know about a transformers model, and the models it refuses.

`inspect_model` reads the model's config once, before anything is allocated: the layer
count, heads, head size, dtype and vocabulary size the paged KV cache and the executor's
inputs are built from. Everything the paged runners cannot reproduce exactly is refused
here, with the model's name and the reason, rather than producing wrong logits later:

- attention that does not go through transformers' AttentionInterface (nothing to
  route): found by what the model does, not by its class's `_supports_attention_backend`
  (registration.py: it switches to "xgraph"; probe.py: its calls come through it, and a
  decode step gives the same logits);
- encoder-decoder and composite (multimodal) models: xgraph runs one causal text decoder
  (sub-configs that only group a decoder's own settings, DBRX's or MPT's, or describe a
  model this class does not hold, are not towers);
- layers that are not softmax attention (linear attention, state-space Mamba layers, short
  convolutions, chunked attention): the paged cache holds keys and values only; the
  refusal names the layers and their modules (recurrent.py);
- query heads that are not a multiple of the kv heads, keys and values of different sizes
  (multi-head latent attention): the paged layout holds one head size per layer;
- logit soft-capping inside attention: the runners compute plain scaled softmax;
- sliding-window layers whose window is shorter than the longest sequence the cache
  allows (`ModelSpec.check_context`): within the window they are exact, past it not.

Layers may differ in heads and head size (per-layer configs): the probe (probe.py) reads
each attention call's shapes, and the cache gives every call a layout of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import recurrent
from .errors import UnsupportedModelError

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class ModelSpec:
    """The attention layout of a decoder, as the paged cache and the executor see it."""

    name: str
    num_layers: int
    num_heads: int  # of the first layer (layers of a per-layer config may differ)
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int | None  # the longest sequence its position embeddings allow, if any
    dtype: torch.dtype
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # RoBERTa-style embeddings number tokens from pad_position + 1 and give padding tokens
    # pad_position (their padding_idx); None: positions are token indices
    pad_position: int | None = None

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


def _towers(model: Any) -> list[str]:
    """Sub-configs of models this one holds beside its text decoder (a vision or audio
    tower, a depth decoder). A sub-config with no model_type only groups the decoder's own
    settings (DBRX's, MPT's); one with no module of this model built from it describes a
    model that a class of its own holds (MoshiForCausalLM is Moshi's text decoder alone)."""
    config = model.config
    subs = getattr(config, "sub_configs", None) or {}
    towers = []
    for key in sorted(subs):
        sub = getattr(config, key, None)
        if key == "text_config" or sub is None or getattr(sub, "model_type", None) == "":
            continue
        if any(m is not model and _built_from(m, sub, config) for m in model.modules()):
            towers.append(key)
    return towers


def _built_from(module: Any, sub: Any, config: Any) -> bool:
    own = getattr(module, "config", None)
    return own is sub or (own is not None and type(own) is type(sub) is not type(config))


def _check_kind(model: Any, name: str) -> None:
    """A causal text decoder. Whether its attention goes through the AttentionInterface is
    what it does, not what its class says (`_supports_attention_backend` also asks for
    things xgraph does not need): registration.py checks that it switches to "xgraph" and
    the probe that every call comes through it and that decode gives the same logits."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            name,
            "it is an encoder-decoder model; xgraph runs causal "
            "decoders (every attention layer causal self-attention)",
        )
    towers = _towers(model)
    if towers:
        raise UnsupportedModelError(
            name,
            f"it is a composite model (sub-models {towers} beside its text decoder)",
            "Load its text decoder on its own (the *ForCausalLM class of the text config).",
        )
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):
        raise UnsupportedModelError(
            name,
            "it is not a causal language model (no LM head to generate with)",
            "Load it with AutoModelForCausalLM.",
        )


def per_layer(config: Any, field: str, num_layers: int) -> list[Any]:
    """A config field's value for every layer: per-layer configs (transformers'
    `per_layer_config`) may set some fields layer by layer, and refuse a global read."""
    varying = getattr(config, "per_layer_attributes", None) or ()
    if getattr(config, "is_heterogeneous", False) and field in varying:
        return [getattr(config.per_layer_config[i], field, None) for i in range(num_layers)]
    return [getattr(config, field, None)] * num_layers


def _check_layers(model: Any, name: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the sliding layers; refuse layers that are not attention,
    naming them (recurrent.py)."""
    config = model.config
    types = getattr(config, "layer_types", None)
    windows = per_layer(config, "sliding_window", num_layers)
    if types is not None:
        other = sorted(set(types) - {FULL, SLIDING} - recurrent.STATELESS)
        if other:
            raise UnsupportedModelError(name, recurrent.describe(model, types, other))
        sliding = tuple(i for i, t in enumerate(types) if t == SLIDING)
    else:  # Mistral-style configs: a window in the config applies to every layer
        sliding = tuple(i for i, w in enumerate(windows) if w)
    missing = [i for i in sliding if not windows[i]]
    if missing:
        raise UnsupportedModelError(
            name,
            f"layers {_short(missing)} are sliding-window layers "
            "but the config gives no sliding_window",
        )
    if any(c is not None for c in per_layer(config, "attn_logit_softcapping", num_layers)):
        raise UnsupportedModelError(
            name,
            "its attention soft-caps the logits (attn_logit_softcapping); xgraph's "
            "runners compute plain scaled softmax",
        )
    return (min(windows[i] for i in sliding) if sliding else None), sliding


def _heads(config: Any, name: str, num_layers: int) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of the first layer; every layer checked."""
    if getattr(config, "kv_lora_rank", None) is not None:
        raise UnsupportedModelError(
            name,
            "it uses multi-head latent attention (kv_lora_rank): keys and values have "
            "different sizes, and the paged cache stores both at one head dim",
        )
    heads = per_layer(config, "num_attention_heads", num_layers)
    kvs = per_layer(config, "num_key_value_heads", num_layers)
    dims = per_layer(config, "head_dim", num_layers)
    hidden = config.hidden_size
    first: tuple[int, int, int] | None = None
    for i, (h, kv, d) in enumerate(zip(heads, kvs, dims)):
        kv = kv or h
        d = d or (hidden // h if isinstance(h, int) and h else None)
        for field_name, value in (("num_attention_heads", h), ("num_key_value_heads", kv)):
            if not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(
                    name, f"layer {i} has {field_name}={value!r}, not a positive number"
                )
        if h % kv:
            raise UnsupportedModelError(
                name,
                f"layer {i} has num_key_value_heads={kv}, which does not divide "
                f"num_attention_heads={h}: every kv head must serve the same number of "
                "query heads",
                "Fix the config: num_attention_heads must be a multiple of num_key_value_heads.",
            )
        first = first or (h, kv, d)
    assert first is not None
    return first  # type: ignore[return-value]


def _pad_position(model: Any) -> int | None:
    """padding_idx of embeddings that number positions from padding_idx + 1 when given no
    position ids (RoBERTa and its descendants: `create_position_ids_from_input_ids`)."""
    for m in model.modules():
        pad = getattr(m, "padding_idx", None)
        if hasattr(m, "create_position_ids_from_input_ids") and isinstance(pad, int):
            return pad
    return None


def inspect_model(model: Any) -> ModelSpec:
    """The model's ModelSpec, or UnsupportedModelError naming the model and the reason."""
    name = model_name(model)
    _check_kind(model, name)
    config = model.config
    num_layers = config.num_hidden_layers
    window, sliding = _check_layers(model, name, num_layers)
    if per_layer(config, "num_attention_heads", num_layers)[0] is None:
        no_attention = recurrent.describe_no_attention(model)  # RWKV, xLSTM
        if no_attention:
            raise UnsupportedModelError(name, no_attention)
    decays = recurrent.decay_modules(model)
    if decays:  # state-space layers a config without layer_types does not list
        raise UnsupportedModelError(
            name,
            f"modules {_short(decays)} hold a state-space decay (A_log): state-space "
            "(Mamba) or linear-attention layers, which keep a recurrent state per sequence; "
            "xgraph's paged cache holds the keys and values of softmax attention only",
        )
    heads, kv, head_dim = _heads(config, name, num_layers)
    param = next(model.parameters(), None)
    pad = _pad_position(model)
    max_position = getattr(config, "max_position_embeddings", None)
    if pad is not None and max_position is not None:
        max_position -= pad + 1  # positions pad + 1, pad + 2, ... index the table
    return ModelSpec(
        name=name,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_position=max_position,
        dtype=param.dtype if param is not None else torch.float32,
        sliding_window=window,
        sliding_layers=sliding,
        pad_position=pad,
    )
