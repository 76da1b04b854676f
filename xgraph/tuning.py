"""A compiled forward's first launch, made at the smallest bucket.

Triton times a generated kernel's candidate launch configurations at the kernel's first
launch and keeps the fastest for every later size. A forward compiled once for every token
count (xgraph.compiled.TokenCompiled) launches the same kernels at every bucket, so the size
of that first launch decides them all. Captures go largest first, and an engine's first
step is often a long prefill: picked at 512 tokens, a transformers Qwen3's query-key norm
and rotary kernel ran its 28 launches of a step at 8 tokens in 113.5 us against 46.0 us
picked otherwise (H200, bf16, docs/results/h200/compile-pass/hint.json). Picked at the
smallest size, each kernel gets the most blocks where blocks are scarce; at large sizes
every candidate has blocks to spare.

So an executor made with `compiled=True` runs one synthetic step (dummy slot and block only,
eagerly, nothing recorded) at its smallest bucket of 2 or more tokens before the forward's
first launch at any other size. A forward compiled per size compiles that size then, which
its capture would do anyway.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .options import Kind

if TYPE_CHECKING:
    from .executor import GraphExecutor
    from .steps import Step

logger = logging.getLogger("xgraph")


def tuning_size(sizes: list[int]) -> int | None:
    """The token count a compiled forward first launches at: the smallest bucket of 2 or
    more (Dynamo gives a single token a graph of its own), None without one."""
    return next((n for n in sorted(sizes) if n >= 2), None)


def launch_small_first(ex: GraphExecutor, step: Step) -> Any:
    """Before `step`, the forward's first launch, run the synthetic step at tuning_size
    (unless `step` is of that size itself)."""
    n = tuning_size(list(ex.buckets.sizes))
    if n is None or step.padded.get("num_tokens", step.num_tokens) == n:
        return
    kind = Kind.FULL if ex.decode_runner is not None else Kind.PIECEWISE
    tensors, attn = ex.planner.synthetic(n, kind, {})
    small = ex.planner.plan(tensors, attn, kind=Kind.EAGER, synthetic=True)
    views = {k: v.to(ex.device) for k, v in small.tensors.items()}
    logger.debug("%s: the compiled forward's first launch, at %d tokens", ex.name, n)
    ex._eager_forward(views, small, kind)
