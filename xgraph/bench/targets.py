"""The models `xgraph bench memory` captures: one family each, both graph kinds.

- `reference`: the reference Qwen3-style model (`--model` picks its shape).
- `hf-llama`: Hugging Face transformers' own LlamaForCausalLM with random weights, run
  through `xgraph.integrations.transformers.GraphModel` (its attention routed through
  xgraph over a paged cache, the model's code unchanged): Llama 3.2 1B's shape next to
  qwen3-0.6b, a tiny one next to tiny. transformers is an optional extra: without it the
  family is skipped, with the reason.

A target makes fresh executors over one model, KV cache and set of weights, so each
measured capture pays for graphs only (`mode="eager"`: an executor that records nothing).
The layouts are small: captures touch the dummy
block alone, and full-graph captures need one sequence per token, piecewise ones as few
sequences as the block-table width allows.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..executor import GraphExecutor
from ..interfaces import Backend
from ..memory import GraphMemory
from ..models import Workload
from ..paging import PagedAttention
from .report import workload

FAMILIES = ("reference", "hf-llama")
HF_SHAPES = {"tiny": "tiny-llama", "qwen3-0.6b": "llama-3.2-1b"}  # the reference's peer
PIECEWISE_SEQS = 16
FULL_CONTEXT = 64  # tokens per sequence in full-graph layouts (decode captures use one)


class Target(Protocol):
    model: str  # the shape's name

    def executor(
        self, kind: str, sizes: list[int], memory: GraphMemory | None, mode: str | None = None
    ) -> GraphExecutor: ...
    def close(self) -> None: ...


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Reference:
    def __init__(self, backend: Backend, model: str, full_max: int, piecewise_max: int) -> None:
        self.backend, self.model = backend, model
        self.full = workload(backend, model, max_seqs=full_max, context=FULL_CONTEXT)
        bs = self.full.block_size
        self.piecewise = Workload(self.full.model, _blocks(piecewise_max, bs), PIECEWISE_SEQS)
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


class HFLlama:
    def __init__(self, backend: Backend, model: str, full_max: int, piecewise_max: int) -> None:
        from ..integrations.transformers.bench_runs import build_named  # optional extra
        from ..integrations.transformers.model import GraphModel

        self.backend, self.model = backend, HF_SHAPES.get(model, model)
        dtype = torch.float32 if backend.device.type == "cpu" else torch.bfloat16
        hf = build_named(self.model, dtype, backend.device)
        # the GraphModel's own executor never captures: executors come from `executor`
        self.gm = GraphModel(
            hf,
            backend=backend,
            buckets=[1],
            max_seqs=full_max,
            max_model_len=max(piecewise_max, FULL_CONTEXT),
            num_blocks=16,
            name="bench-hf",
        )
        bs = self.gm.limits.block_size
        self.layouts = {
            "full": (full_max, _blocks(FULL_CONTEXT, bs)),
            "piecewise": (PIECEWISE_SEQS, _blocks(piecewise_max, bs)),
        }
        self.dtype = str(dtype)

    def executor(
        self, kind: str, sizes: list[int], memory: GraphMemory | None, mode: str | None = None
    ) -> GraphExecutor:
        seqs, blocks = self.layouts[kind]
        return GraphExecutor(
            self.gm.forward,
            inputs=self.gm.inputs(),
            backend=self.backend,
            buckets=sizes,
            attention=PagedAttention.for_cache(self.gm.cache, seqs, blocks),
            memory=memory,
            mode=mode or kind,
            name=f"bench-hf-{kind}",
            on_capture_error="raise",
        )

    def close(self) -> None:
        self.gm.close()  # the model gets its own attention implementation back


def build(family: str, backend: Backend, model: str, full_max: int, piecewise_max: int) -> Any:
    """A target of `family` for the reference shape `model`; raises MissingExtraError (with
    how to install it) for hf-llama without transformers."""
    if family == "reference":
        return Reference(backend, model, full_max, piecewise_max)
    if family == "hf-llama":
        return HFLlama(backend, model, full_max, piecewise_max)
    raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")
