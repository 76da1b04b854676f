"""The "xgraph" attention implementation: transformers' attention layers call xgraph.attention.

transformers looks each layer's attention function up by `config._attn_implementation` in
its AttentionInterface. Registering one under "xgraph" and switching the model to it
(registration.py) routes every layer through `xgraph.attention` without touching the
model's code. No mask function is registered under that name, so transformers skips
building masks altogether: which keys a token sees (causal, within its own sequence) comes
from the executor's paged metadata.

The model runs with batch 1 and the step's tokens flattened into one row, so a layer
hands over q [1, heads, tokens, dim] and k, v [1, kv_heads, tokens, dim]; they are
reshaped to xgraph's [tokens, heads, dim]. Every attention call of a forward has a cache
layer of its own, picked by the call's order in the forward: a layer that calls attention
twice (DiffLlama) or runs in a loop (Dory, HRM) gets one cache layer per call, so no call
overwrites another's keys and values. The probe before the first step (probe.py) saw the
calls in that order; each call is checked against it. The function runs only while the
forward runs eagerly (probe, warm-up, eager steps) or is being captured; a replay never
calls it, so its checks cost nothing per step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from ...attention import attention as xgraph_attention
from ...compiled_layers import outside_graph
from ...errors import XGraphError
from .cache import PagedCache
from .probe import AttentionCall
from .spec import ModelSpec

logger = logging.getLogger("xgraph")

IMPLEMENTATION = "xgraph"


class Answer(Protocol):
    """What answers the attention calls of one forward: a GraphModel step, or the probe."""

    def begin(self) -> None: ...

    def end(self) -> None: ...

    def attend(
        self,
        module: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any,
        scaling: float | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor: ...


class Binding:
    """A GraphModel's steps: its cache, one layer per attention call the probe saw."""

    def __init__(self, spec: ModelSpec, cache: PagedCache, calls: Sequence[AttentionCall]):
        self.spec, self.cache, self.calls = spec, cache, tuple(calls)
        self.count = 0  # attention calls so far in this forward
        self._mask_noted = False
        # its calls out of Dynamo's graphs (compiled layers: `leave_graphs`), else None
        self.outside: Any = None

    def begin(self) -> None:
        self.count = 0

    def end(self) -> None:
        if self.count != len(self.calls):
            raise self.spec.refuse(
                f"its forward called attention {self.count} times through the 'xgraph' "
                f"implementation, where the probe before the first step saw "
                f"{len(self.calls)} calls: its attention calls change from forward to "
                "forward (or its attention implementation was switched away from 'xgraph')",
            )

    def _expected(self, module: Any, k: torch.Tensor) -> int:
        """The cache layer of this call; refuse a call the probe did not see."""
        i = self.count
        self.count += 1
        if i >= len(self.calls) or self.calls[i].module is not module:
            got = type(module).__name__
            raise self.spec.refuse(
                f"attention call {i} of its forward came from {got}, not from what the probe "
                "before the first step saw there: its attention calls change from forward "
                "to forward",
            )
        k_cache = self.cache.layers[i][0]
        want = (k_cache.shape[2], k_cache.shape[3], k_cache.dtype)
        if (k.shape[1], k.shape[3], k.dtype) != want:
            raise self.spec.refuse(
                f"{self.calls[i].where} now hands over keys of {k.shape[1]} heads of dim "
                f"{k.shape[3]} in {k.dtype}, where its cache layer holds {want[0]} heads of "
                f"dim {want[1]} in {want[2]} (the model changed after the GraphModel was "
                "built)",
                "Build a new GraphModel after changing the model (its dtype, its layers).",
            )
        return i

    def attend(
        self,
        module: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any,
        scaling: float | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        layer = self._expected(module, k)
        if mask is not None and not self._mask_noted:
            # a mask function registered under "xgraph" makes transformers build one; the
            # probe found it causal, and the paged metadata already says which keys each
            # token sees, so it is not used
            self._mask_noted = True
            logger.warning(
                "%s: the attention mask transformers built is ignored; xgraph's paged "
                "metadata defines causal attention within each sequence",
                self.spec.name,
            )
        # [1, heads, tokens, dim] -> [tokens, heads, dim], rows of any stride (slices of a
        # merged qkv, as the reference model hands xgraph.attention), dims contiguous
        q, k, v = _rows(q), _rows(k), _rows(v)
        out = xgraph_attention(q, k, v, self.cache.layers[layer], scale=scaling)
        return out.unsqueeze(0)  # [1, tokens, heads, dim], as transformers' own functions


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[1, heads, tokens, dim] as [tokens, heads, dim] with a unit-stride last dim."""
    x = x[0].transpose(0, 1)
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


_local = threading.local()


@contextmanager
def bound(answer: Answer) -> Iterator[None]:
    """Make `answer` take the attention calls of one forward in this thread."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    answer.begin()
    stack.append(answer)
    try:
        yield
    finally:
        stack.pop()
    answer.end()  # only when the forward returned: its calls are all counted


def _current(module: Any) -> Answer:
    stack = getattr(_local, "stack", None)
    if not stack:
        raise XGraphError(
            f"{type(module).__name__} called the 'xgraph' attention outside a GraphModel step. "
            "Run the model through xgraph.integrations.transformers.GraphModel, or switch it "
            "back with model.set_attn_implementation('sdpa') to call it directly."
        )
    return stack[-1]


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
    answer = _current(module)
    attend = getattr(answer, "outside", None) or _attend
    return attend(answer, module, query, key, value, attention_mask, scaling, kwargs), None


def _attend(answer: Answer, module: Any, *args: Any) -> torch.Tensor:
    return answer.attend(module, *args)


def leave_graphs(binding: Binding) -> None:
    """Make the binding's attention calls graph breaks wherever Dynamo traces them (a
    GraphModel compiling its layers one by one, xgraph.compiled_layers): the layer's cache,
    picked by the binding's Python state, is then never guarded on. Made here, not at
    import: it loads the compiler."""
    binding.outside = outside_graph(_attend)
