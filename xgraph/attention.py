"""The attention call site models use, and the step contexts that answer it.

Model code calls `xgraph.attention(q, k, v, kv_cache, scale=...)` at every attention layer.
What that call does depends on the step context the executor has set:

- eager / full-graph capture: the runner runs inline (inside a full graph it is recorded,
  so it must be graph-safe: fixed launch shape, every per-step value read from device);
- piecewise capture: the current piece ends, the call is recorded as a runner instruction
  (q, k, v, the preallocated out and the cache), the next piece begins; replay runs
  piece, runner, piece, ... with the runner planned on this step's metadata.

Compiled code reaches the same contexts through the custom op `xgraph::attention`, which
declares the in-place cache writes; see `attention`.

A profile run before the KV cache exists (`xgraph.profile_run`) answers the call with the
backend's prefill runner over a scratch cache of the step's own tokens.

Calling attention kernels directly instead (bypassing the call site) is detected during a
piecewise capture and refused, because such a kernel would be frozen into a piece with the
batch composition of the capture step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from .errors import XGraphError
from .interfaces import AttentionRunner
from .metadata import AttentionMetadata, KVCache
from .opdef import define, refuse_grad

# -- step contexts -------------------------------------------------------------------------


class StepContext(Protocol):
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, scale: float
    ) -> torch.Tensor: ...


_local = threading.local()


def _stack() -> list[StepContext]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


@contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Make `ctx` answer `xgraph.attention` calls in this thread until the block ends."""
    s = _stack()
    s.append(ctx)
    try:
        yield ctx
    finally:
        s.pop()


def current_context() -> StepContext | None:
    """The step context answering `xgraph.attention` in this thread, or None outside a step."""
    s = _stack()
    return s[-1] if s else None


class InlineRunner:
    """Context that runs a planned runner inline (eager steps, full-graph capture)."""

    def __init__(self, runner: AttentionRunner, require_graph_safe: bool = False) -> None:
        if require_graph_safe and not runner.graph_safe:
            raise XGraphError(
                f"{type(runner).__name__} is not graph-safe, so it cannot run inside a full "
                "graph. Use a graph-safe runner for decode, or the piecewise mode."
            )
        self.runner = runner

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        self.runner.run(q, k, v, out, kv_cache, scale)
        return out


@contextmanager
def eager_attention(runner: AttentionRunner, metadata: AttentionMetadata) -> Iterator[None]:
    """Plan `runner` on `metadata` and run every `xgraph.attention` call eagerly with it."""
    runner.plan(metadata)
    with step_context(InlineRunner(runner)):
        yield


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, scale: float
) -> torch.Tensor:
    """Hand the call to the innermost step context of this thread."""
    s = _stack()
    if not s:
        raise XGraphError(
            "xgraph.attention was called outside a step. Run the forward through a "
            "GraphExecutor, inside `with eager_attention(runner, metadata):` (xgraph.attention), "
            "or, before the KV cache exists, inside `with xgraph.profile_step(query_lens):`."
        )
    return s[-1].attend(q, k, v, kv_cache, scale)


def _attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`xgraph::attention`: the call site as compiled code sees it, one opaque op.

    It declares the cache writes (k_cache, v_cache), so the compiler keeps them in place
    instead of rewriting them as whole-cache copies, and returns a fresh tensor laid out as
    `torch.empty_like(q)` (what every step context returns).
    """
    refuse_grad("attention", q, k, v)
    return _attend(q, k, v, (k_cache, v_cache), scale)


def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


attention_op = define("attention", _attention_kernel, _attention_fake, ("k_cache", "v_cache"))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The attention call site: store k, v in the paged cache and attend q over it.

    q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]; returns [tokens, heads, dim].
    Under torch.compile the call becomes the custom op `xgraph::attention` (no graph break):
    compiled code calls it like any kernel, and it runs the step context (inline runner or
    piecewise cut). Eager calls go to the step context directly, so a dispatch mode (a host
    graph's op recorder, the capture checks) sees the runner's ops, not one opaque op that
    takes the cache.
    """
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        k_cache, v_cache = kv_cache
        return attention_op(q, k, v, k_cache, v_cache, float(scale))
    return _attend(q, k, v, kv_cache, scale)
