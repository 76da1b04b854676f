"""The transformers integration's model family of `xgraph bench memory`: `hf-llama`.

Hugging Face transformers' own LlamaForCausalLM with random weights, run through
GraphModel (its attention routed through xgraph over a paged cache, the model's code
unchanged): Llama 3.2 1B's shape next to the reference's qwen3-0.6b, a tiny one next to
tiny. `register()` offers it to the bench (`xgraph.bench.register_target`); the package
calls it when imported, which the `xgraph` command line does. transformers is an optional
extra: without it, building the target raises MissingExtraError and the bench lists the
family as skipped, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from ...bench import register_target
from ...executor import GraphExecutor
from ...interfaces import Backend
from ...memory import GraphMemory
from ...paging import PagedAttention

FAMILY = "hf-llama"
SHAPES = {"tiny": "tiny-llama", "qwen3-0.6b": "llama-3.2-1b"}  # the reference shape's peer
# fewer sizes than the reference on accelerators: its eager Python forward runs twice per
# capture (the warm-up and the capture itself); (accelerator, CPU)
LARGEST = {"full": (256, 64), "piecewise": (1024, 128)}


class HFLlama:
    """A bench target (xgraph.bench.targets.Target) over one GraphModel's model and cache."""

    def __init__(self, backend: Backend, model: str, full_max: int, piecewise_max: int) -> None:
        from ...bench.targets import FULL_CONTEXT, PIECEWISE_SEQS, blocks
        from .bench_runs import build_named
        from .model import GraphModel

        self.backend, self.model = backend, SHAPES.get(model, model)
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
            "full": (full_max, blocks(FULL_CONTEXT, bs)),
            "piecewise": (PIECEWISE_SEQS, blocks(piecewise_max, bs)),
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


def build(backend: Any, model: str, full_max: int, piecewise_max: int) -> HFLlama:
    """The registered builder (HFLlama looked up when called, so a test can replace it)."""
    return HFLlama(backend, model, full_max, piecewise_max)


def register() -> None:
    """Offer `hf-llama` to `xgraph bench memory` (again: the same builder)."""
    register_target(FAMILY, build, LARGEST)
