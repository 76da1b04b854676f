"""GraphModel: a transformers causal LM behind a GraphExecutor, built from the model's config.

    gm = GraphModel.from_pretrained("path/to/folder")        # or GraphModel(model)
    result = gm.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)

The model's code is not changed: its attention implementation is switched to "xgraph"
(given back when the last GraphModel over the model closes), one probe forward before the
first step records its attention calls (probe.py: whatever the runners would compute
differently is refused there), a paged KV cache is allocated with one layer per call, and
its forward is wrapped as `forward(input_ids, positions) -> logits` (forward.py). The
executor then runs decode steps as full graphs and prefill / chunked-prefill / mixed steps
piecewise, like any engine's model.

A GraphModel dropped without `close()` is closed when it is collected: its executor first
(queued work, graphs, graph memory), then the model's attention; its cache goes with it.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import torch

from ...buckets import Buckets, Input, default_sizes
from ...errors import XGraphError
from ...executor import GraphExecutor
from ...interfaces import Backend
from ...memory import GraphMemory
from ...metadata import AttentionInputs
from ...options import Fallback, Kind, Mode
from ...paging import PagedAttention
from ...plugins import get_backend
from ...pool import SharedPhysicalPool
from . import registration
from .attention import Binding
from .cache import PagedCache
from .forward import ModelForward
from .generate import GenerationResult, generate
from .limits import Limits
from .loading import load_model, load_tokenizer
from .probe import probe
from .spec import inspect_model

logger = logging.getLogger("xgraph")


def _release(executor: GraphExecutor, model: Any, name: str) -> None:
    """Close in order: the executor (waits for queued work, resets its graphs, frees graph
    memory), then the model's attention. Runs once, from close() or from the garbage
    collector, so it reports a failure and never raises."""
    try:
        executor.close()
    except Exception:
        logger.exception("%s: closing its executor failed", name)
    try:
        registration.release(model)
    except Exception:
        logger.exception("%s: giving the model back its attention failed", name)


class GraphModel:
    """A transformers causal LM run through xgraph: paged cache, executor, generation loop.

    Args:
        model: a transformers *ForCausalLM (an object; see `from_pretrained` for a folder).
        backend: a backend name or object, or None (XGRAPH_BACKEND, else the best one). The
            model is moved to its device.
        buckets: num_tokens buckets (default: xgraph.buckets.default_sizes(max_num_tokens)).
        mode, memory, on_capture_error, name: passed to the GraphExecutor.
        limits / block_size, max_model_len, max_seqs, num_blocks, max_num_tokens: see Limits.
    """

    def __init__(
        self,
        model: Any,
        *,
        backend: str | Backend | None = None,
        buckets: Buckets | list[int] | None = None,
        mode: Mode | str = Mode.AUTO,
        memory: str | GraphMemory | SharedPhysicalPool | None = None,
        on_capture_error: Fallback | str = Fallback.EAGER,
        name: str = "transformers",
        limits: Limits | None = None,
        **limit_fields: int,
    ) -> None:
        self.spec = inspect_model(model)
        unknown = set(limit_fields) - {f.name for f in dataclasses.fields(Limits)}
        if unknown:
            raise XGraphError(
                f"GraphModel got unknown arguments {sorted(unknown)}; the limits "
                f"are {[f.name for f in dataclasses.fields(Limits)]}."
            )
        self.limits = dataclasses.replace(limits or Limits(), **limit_fields).resolve(self.spec)
        self.backend = get_backend(backend)
        self.device = self.backend.device
        self.model = model.to(self.device).eval()
        self.tokenizer: Any = None  # set by from_pretrained when the folder has one
        lim = self.limits
        assert lim.num_blocks is not None and lim.max_model_len is not None
        registration.acquire(model)
        try:
            self._forward = ModelForward(self.model, self.spec)
            self.calls = probe(self._forward.run, self.spec, model, lim.max_model_len, self.device)
            self.cache = PagedCache(
                self.spec, lim.num_blocks, lim.block_size, self.device, calls=self.calls
            )
            self.binding = self._forward.binding = Binding(self.spec, self.cache, self.calls)
            self.executor = GraphExecutor(
                self._forward,
                inputs=self.inputs(),
                backend=self.backend,
                buckets=buckets if buckets is not None else default_sizes(lim.max_num_tokens),
                attention=PagedAttention.for_cache(
                    self.cache, lim.max_seqs, lim.max_blocks_per_seq
                ),
                memory=memory,
                mode=mode,
                on_capture_error=on_capture_error,
                name=name,
            )
        except BaseException:  # refused: the model keeps its own attention
            registration.release(model)
            raise
        self._finalizer = weakref.finalize(self, _release, self.executor, model, name)

    @classmethod
    def from_pretrained(
        cls,
        folder: str,
        *,
        dtype: torch.dtype | str | None = None,
        backend: str | Backend | None = None,
        **kwargs: Any,
    ) -> GraphModel:
        """Load a local folder (config.json + safetensors) and wrap it; keeps its tokenizer."""
        b = get_backend(backend)
        gm = cls(load_model(folder, dtype=dtype, device=b.device), backend=b, **kwargs)
        gm.tokenizer = load_tokenizer(folder)
        return gm

    def inputs(self) -> list[Input]:
        """Token ids within the vocabulary, positions within max_model_len (checked per step,
        so a bad id is an InputError naming it, not a failure inside a replay)."""
        assert self.limits.max_model_len is not None
        return [
            Input(
                "input_ids", torch.int64, ("num_tokens",), fill=0, bounds=(0, self.spec.vocab_size)
            ),
            Input(
                "positions",
                torch.int64,
                ("num_tokens",),
                fill=0,
                bounds=(0, self.limits.max_model_len),
            ),
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[tokens] ids and positions -> [tokens, vocab] logits: the model's own forward, on
        one batch row, with position_ids from the step (rotary tables index by them)."""
        return self._forward(input_ids, positions)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionInputs,
        clone: bool = False,
    ) -> torch.Tensor:
        """One step through the executor (views of its output buffer unless clone=True)."""
        return self.executor(input_ids=input_ids, positions=positions, attn=attn, clone=clone)

    def capture(self, progress: bool = False) -> None:
        """Capture before serving: decode graphs up to max_seqs, piecewise graphs for every
        bucket (otherwise each is captured on its first step)."""
        buckets = self.executor.buckets
        sizes = buckets.sizes
        largest_decode = buckets.pad(self.limits.max_seqs) or buckets.max
        decode = sorted((s for s in sizes if s <= largest_decode), reverse=True)
        if self.executor.mode in (Mode.AUTO, Mode.FULL):
            self.executor.capture(decode, kind=Kind.FULL, progress=progress)
        if self.executor.mode in (Mode.AUTO, Mode.PIECEWISE):
            self.executor.capture(
                sorted(sizes, reverse=True), kind=Kind.PIECEWISE, progress=progress
            )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | list[int] = 16, **kwargs: Any
    ) -> GenerationResult:
        """Generate for many prompts at once; see generate.generate for the arguments."""
        return generate(self, prompts, max_new_tokens, **kwargs)

    def stats(self) -> dict[str, Any]:
        return self.executor.stats()

    def close(self) -> None:
        """Close the executor; the last GraphModel over the model gives it back its own
        attention implementation. Idempotent; runs by itself when the GraphModel is
        collected."""
        self._finalizer()

    def __enter__(self) -> GraphModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
