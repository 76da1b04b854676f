"""The PDL race check over the reference model's decode buckets, as `xgraph check` runs it.

Per bucket, the decode step's forward on static inputs is captured twice as a full graph
through the backend's own graph API (as the executor captures a key): inside the backend's
PDL capture option and inside its baseline (the same kernels without the PDL launch
attribute). `xgraph.pdl.race_check` then replays the pair N times with new token ids
before each pair and compares the final hidden states bit for bit. A backend without
`Kernels.pdl` has nothing to check: `check_decode` says so and returns no reports.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from .attention import step_context
from .interfaces import Backend, Graph
from .models import Workload
from .pdl import RaceReport, capture_options, race_check


def _capture(
    backend: Backend, kernels: Any, forward: Callable[[], torch.Tensor], baseline: bool
) -> tuple[Graph, Any, torch.Tensor]:
    """(graph, its pool, its output): warm-up and capture under the same option, so the
    launch variants the option picks compile before the capture."""
    with capture_options(kernels, "full", not baseline, baseline=baseline):
        with backend.warmup_context():
            forward()
        backend.synchronize()
        graph, pool = backend.new_graph(), backend.new_pool()
        graph.capture_begin(pool, check_ops=False)
        try:
            out = forward()
        except BaseException:
            graph.abort()
            raise
        graph.capture_end()
    return graph, pool, out


def _bucket(backend: Backend, w: Workload, b: int, replays: int, seed: int) -> RaceReport:
    from .bench.anchors import static_inputs

    kernels = backend.activate()
    step = w.decode_step(random.Random(seed + b), b, max_context=256)
    step = step.with_tensor_tables(w.max_blocks, w.cache.dummy_block)
    ids, pos, ctx, _ = static_inputs(backend, w, step)

    def forward() -> torch.Tensor:
        with torch.no_grad(), step_context(ctx):
            return w.model.forward(ids, pos)

    on = _capture(backend, kernels, forward, baseline=False)
    off = _capture(backend, kernels, forward, baseline=True)
    g = torch.Generator(device=ids.device).manual_seed(seed)
    vocab = w.model.config.vocab_size

    def feed(i: int) -> None:
        ids.copy_(torch.randint(0, vocab, ids.shape, device=ids.device, generator=g))

    def replay(graph: Graph, out: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
        def call() -> list[torch.Tensor]:
            graph.replay()
            backend.synchronize()
            return [out]

        return call

    return race_check(replay(on[0], on[2]), replay(off[0], off[2]), feed, replays, b)


def check_decode(
    backend: Backend, model: str, buckets: list[int], replays: int = 200, seed: int = 0
) -> list[RaceReport] | None:
    """The race check of each decode bucket of a reference model shape (bf16 on accelerators,
    random weights), or None where the backend has no programmatic dependent launch."""
    from .bench.report import workload

    if backend.activate().pdl is None:
        return None
    w = workload(backend, model, max_seqs=max(buckets), context=512, seed=seed)
    return [_bucket(backend, w, b, replays, seed) for b in buckets]
