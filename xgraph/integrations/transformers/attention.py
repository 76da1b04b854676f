"""The "xgraph" attention implementation: transformers' attention layers call xgraph.attention.

transformers looks each layer's attention function up by `config._attn_implementation` in
its AttentionInterface. Registering one under "xgraph" and switching the model to it routes
every layer through `xgraph.attention` without touching the model's code. No mask function
is registered under that name, so transformers skips building masks altogether: which keys
a token sees (causal, within its own sequence) comes from the executor's paged metadata.

The model runs with batch 1 and the step's tokens flattened into one row, so the layer
hands over q [1, heads, tokens, dim] and k, v [1, kv_heads, tokens, dim]; they are
reshaped to xgraph's [tokens, heads, dim], and the layer's cache is picked by
`module.layer_idx`. The function runs only while the forward runs eagerly (warm-up, eager
steps) or is being captured; a replay never calls it, so its checks cost nothing per step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...attention import attention as xgraph_attention
from ...errors import XGraphError
from .cache import PagedCache
from .deps import require
from .errors import UnsupportedModelError
from .spec import ModelSpec, model_name

logger = logging.getLogger("xgraph")

IMPLEMENTATION = "xgraph"
# keyword arguments that change what attention computes and that the paged runners do not do
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


@dataclass(frozen=True)
class Binding:
    """The model a step runs: its spec, its cache and the longest sequence it allows."""

    spec: ModelSpec
    cache: PagedCache
    max_model_len: int


_local = threading.local()
_masks_noted: set[str] = set()  # models whose ignored mask was logged (once each)


@contextmanager
def bound(binding: Binding) -> Iterator[None]:
    """Make `binding` the model whose cache the attention calls of this thread use."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(binding)
    try:
        yield
    finally:
        stack.pop()


def _current(module: Any) -> Binding:
    stack = getattr(_local, "stack", None)
    if not stack:
        raise XGraphError(
            f"{type(module).__name__} called the 'xgraph' attention outside a GraphModel step. "
            "Run the model through xgraph.integrations.transformers.GraphModel, or switch it "
            "back with model.set_attn_implementation('sdpa') to call it directly."
        )
    return stack[-1]


def _check_call(
    b: Binding,
    module: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kwargs: dict[str, Any],
) -> int:
    """The layer index of a call the paged cache can serve; refuse anything else by name."""
    layer = getattr(module, "layer_idx", None)
    where = f"layer {layer} ({type(module).__name__})"
    if not isinstance(layer, int) or not 0 <= layer < len(b.cache.layers):
        raise b.spec.refuse(
            f"{where} has no layer_idx in 0..{len(b.cache.layers) - 1}, so "
            "xgraph cannot pick its cache"
        )
    if q.dim() != 4 or q.shape[0] != 1:
        raise XGraphError(
            f"{b.spec.name}: {where} got q of shape {tuple(q.shape)}; the GraphModel "
            "forward runs batch 1, [1, heads, tokens, dim]."
        )
    k_cache = b.cache.layers[layer][0]
    want = (k_cache.shape[2], k_cache.shape[3])
    if (
        (k.shape[1], k.shape[3]) != want
        or v.shape[1] != want[0]
        or v.shape[3] != want[1]
        or q.shape[3] != want[1]
    ):
        raise b.spec.refuse(
            f"{where} has q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, but the "
            f"cache was built for {want[0]} kv heads of dim {want[1]} (its attention layers "
            "differ from the config)",
        )
    window = kwargs.get("sliding_window")
    if window is not None and window < b.max_model_len:
        raise b.spec.refuse(
            f"{where} uses a sliding window of {window} tokens, shorter than max_model_len="
            f"{b.max_model_len}",
            f"Build it with max_model_len <= {window}.",
        )
    bad = [n for n in _UNSUPPORTED_KWARGS if kwargs.get(n) is not None]
    if bad or kwargs.get("dropout", 0.0) or not getattr(module, "is_causal", True):
        what = bad or ["dropout" if kwargs.get("dropout") else "non-causal attention"]
        raise b.spec.refuse(
            f"{where} asks for {what}, which the paged runners do not compute",
            "Put the model in eval mode (no dropout); the rest is not supported.",
        )
    return layer


def attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature, answered by `xgraph.attention`."""
    b = _current(module)
    layer = _check_call(b, module, query, key, value, kwargs)
    if attention_mask is not None and b.spec.name not in _masks_noted:
        # a mask function registered under "xgraph" makes transformers build one; the paged
        # metadata already says which keys each token sees, so it is not used
        _masks_noted.add(b.spec.name)
        logger.warning(
            "%s: the attention mask transformers built is ignored; xgraph's paged "
            "metadata defines causal attention within each sequence",
            b.spec.name,
        )
    # [1, heads, tokens, dim] -> [tokens, heads, dim]; contiguous, since device runners of
    # other backends may take raw pointers
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = xgraph_attention(q, k, v, b.cache.layers[layer], scale=scaling)
    return out.unsqueeze(0), None  # [1, tokens, heads, dim], as transformers' own functions


def register() -> None:
    """Register "xgraph" in transformers' AttentionInterface (idempotent)."""
    require().AttentionInterface.register(IMPLEMENTATION, attention_forward)


def use_xgraph_attention(model: Any) -> str:
    """Switch `model` to the "xgraph" implementation; returns the one it had, to restore."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:
        raise UnsupportedModelError(
            model_name(model),
            "it did not switch to the 'xgraph' attention implementation "
            "(transformers could not set it dynamically), so its attention would bypass "
            "xgraph's paged cache",
        )
    # a module with a config of its own (swapped in from another model) keeps that config's
    # implementation and would call its own attention directly
    stray = [
        n
        for n, m in model.named_modules()
        if getattr(getattr(m, "config", None), "_attn_implementation", IMPLEMENTATION)
        != IMPLEMENTATION
    ]
    if stray:
        restore_attention(model, previous)
        raise UnsupportedModelError(
            model_name(model),
            f"modules {stray[:4]} have a config of their own whose attention "
            "implementation is not 'xgraph', so they would bypass xgraph's paged cache",
            "Give them the model's config (module.config = model.config).",
        )
    return previous


def restore_attention(model: Any, previous: str) -> None:
    """Give the model back the implementation it had before `use_xgraph_attention`."""
    if model.config._attn_implementation == IMPLEMENTATION and previous != IMPLEMENTATION:
        model.set_attn_implementation(previous)
