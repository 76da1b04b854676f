"""The models `xgraph bench memory` captures: what a target is, and the reference model's.

A family is registered in `xgraph.bench` (`register_target`) and builds a target:
- `reference` (here): the reference Qwen3-style model (`--model` picks its shape);
- others come from the integrations that register them when imported (the transformers
  integration's `hf-llama`: xgraph/integrations/transformers/bench_target.py).

A target makes fresh executors over one model, KV cache and set of weights, so each
measured capture pays for graphs only (`mode="eager"`: an executor that records nothing).
The layouts are small: captures touch the dummy
block alone, and full-graph captures need one sequence per token, piecewise ones as few
sequences as the block-table width allows.
"""

from __future__ import annotations

from typing import Protocol

from ..executor import GraphExecutor
from ..interfaces import Backend
from ..memory import GraphMemory
from ..models import Workload
from .report import workload

PIECEWISE_SEQS = 16
FULL_CONTEXT = 64  # tokens per sequence in full-graph layouts (decode captures use one)


class Target(Protocol):
    """Fresh executors over one model, KV cache and set of weights, per graph kind."""

    model: str  # the shape's name
    dtype: str  # the weights' torch dtype, as text

    def executor(
        self, kind: str, sizes: list[int], memory: GraphMemory | None, mode: str | None = None
    ) -> GraphExecutor: ...
    def close(self) -> None: ...


def blocks(tokens: int, block_size: int) -> int:
    """KV-cache blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)


class Reference:
    def __init__(self, backend: Backend, model: str, full_max: int, piecewise_max: int) -> None:
        self.backend, self.model = backend, model
        self.full = workload(backend, model, max_seqs=full_max, context=FULL_CONTEXT)
        bs = self.full.block_size
        self.piecewise = Workload(self.full.model, blocks(piecewise_max, bs), PIECEWISE_SEQS)
        self.dtype = str(self.full.model.lm_head.weight.dtype)

    def executor(
        self, kind: str, sizes: list[int], memory: GraphMemory | None, mode: str | None = None
    ) -> GraphExecutor:
        w = self.full if kind == "full" else self.piecewise
        return w.executor(
            w.model.forward,
            backend=self.backend,
            buckets=sizes,
            memory=memory,
            mode=mode or kind,
            name=f"bench-{kind}",
            on_capture_error="raise",
        )

    def close(self) -> None:
        pass
