"""GraphModel: a transformers causal LM behind a GraphExecutor, built from the model's config.

    gm = GraphModel.from_pretrained("path/to/folder")        # or GraphModel(model)
    result = gm.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)

The model's code is not changed: its attention implementation is switched to "xgraph"
(given back when the last GraphModel over the model closes), one probe forward before the
first step records its attention calls (probe.py: whatever the runners would compute
differently is refused there), a paged KV cache is allocated with one layer per call, and
its decoder is wrapped as `forward(input_ids, positions) -> hidden states` (forward.py), the
LM head running after the step on the rows that sample (head.py). The executor then runs
decode steps as full graphs and prefill / chunked-prefill / mixed steps piecewise, like any
engine's model. `compile=True` runs the decoder torch.compile'd inside those graphs, one
compile for every bucket (xgraph.compiled.TokenCompiled); where the backend has a linear
kernel the projections go through it (linears.py).

A GraphModel dropped without `close()` is closed when it is collected: its executor first
(queued work, graphs, graph memory), then the model's attention; its cache goes with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ...buckets import Buckets, Input, default_sizes
from ...decode_loop import DecodeLoop
from ...errors import XGraphError
from ...executor import GraphExecutor
from ...interfaces import Backend
from ...loop_step import StepTail
from ...memory import GraphMemory
from ...metadata import AttentionInputs
from ...options import Fallback, Kind, Mode
from ...paging import PagedAttention
from ...plugins import get_backend
from ...pool import SharedPhysicalPool
from . import fusions, registration
from .attention import Binding, bound
from .cache import PagedCache
from .compiling import check_scope, compile_backend, compile_decoder, settle
from .engine import LOOP_STOP_IDS, Engine, TokenEvent
from .forward import ModelForward
from .generate import GenerationResult, generate, stream
from .head import Head, split_head
from .limits import Limits
from .linears import XLinear, restore_linears, swap_linears
from .loading import load_model, load_tokenizer
from .probe import Probe, probe
from .spec import ModelSpec, inspect_model

logger = logging.getLogger("xgraph")


def _release(
    executor: GraphExecutor, loops: dict[int, DecodeLoop], model: Any, name: str, compiled: Any
) -> None:
    """Close in order: the multi-step loops (their graphs share the executor's memory), the
    executor (waits for queued work, resets its graphs, frees graph memory), then the
    model's attention. Runs once, from close() or from the garbage collector, so it
    reports a failure and never raises."""
    try:
        for loop in loops.values():
            loop.close()
        loops.clear()
        executor.close()
    except Exception:
        logger.exception("%s: closing its executor failed", name)
    try:
        if compiled is not None and hasattr(compiled, "release"):
            compiled.release()  # the layers' own forwards back (compiled layers)
        _release_model(model)
    except Exception:
        logger.exception("%s: giving the model back its attention failed", name)


def _split_head(
    forward: ModelForward, spec: ModelSpec, model: Any, max_model_len: int, device: torch.device
) -> Head | None:
    """The LM head, if it splits off the decoder (head.py), checked on the probe's tokens."""
    n = min(4, max_model_len)
    ids = torch.arange(1, n + 1, device=device) % spec.vocab_size
    positions = torch.arange(n, device=device)

    def full(i: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return forward.run(Probe(spec, model, max_model_len, n), i, p)

    def hidden(decoder: Any, i: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        with bound(Probe(spec, model, max_model_len, n)):
            return forward.hidden(decoder, i, p)

    return split_head(full, hidden, model, ids, positions)


def _limits(spec: ModelSpec, limits: Limits | None, fields: dict[str, int]) -> Limits:
    unknown = set(fields) - {f.name for f in dataclasses.fields(Limits)}
    if unknown:
        raise XGraphError(
            f"GraphModel got unknown arguments {sorted(unknown)}; the limits "
            f"are {[f.name for f in dataclasses.fields(Limits)]}."
        )
    return dataclasses.replace(limits or Limits(), **fields).resolve(spec)


def _release_model(model: Any) -> None:
    """A refused model gets back its attention and its nn.Linear modules."""
    registration.release(model)
    if registration.holders(model) == 0:
        fusions.unfuse_layers(model)
        restore_linears([m for m in model.modules() if type(m) is XLinear])


class _LoopStep:
    """A decode step as the multi-step loop calls it: the forward, then the LM head."""

    def __init__(self, forward: ModelForward) -> None:
        self.forward = forward

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.forward(input_ids, positions)
        head = self.forward.head
        return out if head is None else head(out)


class GraphModel:
    """A transformers causal LM run through xgraph: paged cache, executor, generation loop.

    Args:
        model: a transformers *ForCausalLM (an object; see `from_pretrained` for a folder).
        backend: a backend name or object, or None (XGRAPH_BACKEND, else the best one). The
            model is moved to its device.
        buckets: num_tokens buckets (default: xgraph.buckets.default_sizes(max_num_tokens)).
        mode, memory, on_capture_error, name: passed to the GraphExecutor.
        compile: run the decoder torch.compile'd inside the graphs: True (Inductor, no CUDA
            graphs of its own), or a torch.compile backend name ("aot_eager", "eager": CPU
            tests). One compile serves every bucket (the token count dynamic), one more the
            single-token bucket; `compile_dynamic=False` compiles once per bucket instead.
        compile_scope: what one compile covers: "forward" (the whole decoder, one graph),
            "auto" ("forward", except over fused layers, which then run uncompiled: no
            compile time, slower steps; `stats()` says so) or "layers" (one decoder layer,
            which every layer then runs: a fraction of the compile time, fusion across the
            layers' edges given up; the attention runs between compiled pieces;
            xgraph.compiled_layers, docs/startup.md). None (default): $XGRAPH_COMPILE_SCOPE,
            unset "forward".
        compile_cache: where the compiled decoder is kept for the next process on this
            machine (xgraph.compile_cache): None (default: $XGRAPH_COMPILE_CACHE, else
            ~/.cache/xgraph/compile), a folder, or False (off). Keyed by the model's class and
            config, dtype, device, compile settings and versions: a stale artifact is never
            loaded.
        linear: the projections through xgraph.linear (the backend's kernel where it
            serves; linears.py): None (default) where the backend has a kernel, True, False.
            Where there is a kernel, q/k/v and gate/up projections share one merged call;
            with `fuse_layers` (None: XGRAPH_FUSE_LAYERS; on) and a fused kernel, a Qwen3
            model's layers run over the fused projections (fusions.py; `fused` says
            whether they do).
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
        compile: Any = False,
        compile_dynamic: bool = True,
        compile_scope: str | None = None,
        compile_cache: str | os.PathLike[str] | bool | None = None,
        linear: bool | None = None,
        fuse_layers: bool | None = None,
        limits: Limits | None = None,
        **limit_fields: int,
    ) -> None:
        self.spec = inspect_model(model)
        self.limits = _limits(self.spec, limits, limit_fields)
        compiler = compile_backend(compile)
        compile_scope = check_scope(compile_scope, model, compiler is not None, compile_dynamic)
        self.backend = get_backend(backend)
        self.device = self.backend.device
        self.model = model.to(self.device).eval()
        self.tokenizer: Any = None  # set by from_pretrained when the folder has one
        self.fused = False  # whether its layers run over fused projections (fusions.py)
        self.compile_skipped: str | None = None  # why compile=... left it uncompiled
        lim = self.limits
        assert lim.num_blocks is not None and lim.max_model_len is not None
        registration.acquire(model)
        try:
            self._forward = self._kernels(linear, fuse_layers)
            compiler, compile_scope, self.compile_skipped = settle(
                compiler, compile_scope, self.fused
            )
            self.calls = probe(self._forward.run, self.spec, model, lim.max_model_len, self.device)
            self._forward.head = _split_head(
                self._forward, self.spec, model, lim.max_model_len, self.device
            )
            self.cache = PagedCache(
                self.spec, lim.num_blocks, lim.block_size, self.device, calls=self.calls
            )
            self.binding = self._forward.binding = Binding(self.spec, self.cache, self.calls)
            self.executor = self._executor(
                buckets, memory, mode, on_capture_error, name, compiler is not None
            )
        except BaseException:  # refused: the model keeps its own attention
            _release_model(model)
            raise
        self.compiled = compile_decoder(
            self, compiler, compile_dynamic, name, compile_cache, compile_scope
        )
        self._compiler = compiler  # the multi-step loops' choice and feedback run under it
        self._tail: StepTail | None = None
        self._loops: dict[int, DecodeLoop] = {}
        self._finalizer = weakref.finalize(
            self, _release, self.executor, self._loops, model, name, self.compiled
        )

    def _kernels(self, linear: bool | None, fuse_layers: bool | None) -> ModelForward:
        """The model's forward over the backend's kernels, which serve the core's ops from
        now on (the probe runs them): its projections through them where asked, and a Qwen3
        model's layers over the fused projections (fusions.py)."""
        kernels = self.backend.activate()
        kernel = kernels.linear is not None
        if linear or (linear is None and kernel):
            swap_linears(self.model, merge=kernel)
        forward = ModelForward(self.model, self.spec)
        if fusions.requested(fuse_layers) and kernels.fused_linear is not None:
            assert self.limits.max_model_len is not None
            self.fused = fusions.fuse_checked(
                forward, self.spec, self.model, self.limits.max_model_len
            )
        return forward

    def _executor(
        self,
        buckets: Buckets | list[int] | None,
        memory: str | GraphMemory | SharedPhysicalPool | None,
        mode: Mode | str,
        on_capture_error: Fallback | str,
        name: str,
        compiled: bool,
    ) -> GraphExecutor:
        """The executor over the model's forward, its paged cache and its limits."""
        lim = self.limits
        return GraphExecutor(
            self._forward,
            inputs=self.inputs(),
            backend=self.backend,
            buckets=buckets if buckets is not None else default_sizes(lim.max_num_tokens),
            attention=PagedAttention.for_cache(self.cache, lim.max_seqs, lim.max_blocks_per_seq),
            memory=memory,
            mode=mode,
            on_capture_error=on_capture_error,
            name=name,
            compiled=compiled,
        )

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
        rows: Any = None,
    ) -> torch.Tensor:
        """One step through the executor; the logits of `rows` (default: every token).
        They are fresh tensors where the head runs after the step; views of the executor's
        output buffer otherwise (for every row, unless clone=True)."""
        out = self.step(input_ids, positions, attn)
        if clone and self.head is None and rows is None:
            out = out.clone()
        return self.logits(out, rows)

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs
    ) -> torch.Tensor:
        """One step through the executor: the decoder's hidden states for every token
        (views of the output buffer, valid until the next step), or the logits where the
        head stays in the graphs (`head` is None)."""
        return self.executor(input_ids=input_ids, positions=positions, attn=attn)

    def logits(self, out: torch.Tensor, rows: Any = None) -> torch.Tensor:
        """Logits of `rows` (an index tensor, list or slice; None: all) of a step's output."""
        if isinstance(rows, torch.Tensor):
            out = out.index_select(0, rows.to(out.device))
        elif rows is not None:
            out = out[rows]
        return out if self.head is None else self.head(out)

    @property
    def head(self) -> Head | None:
        """The LM head run after each step on the rows that sample, or None when it stays
        inside the graphs (the model's logits are not its head over its decoder)."""
        return self._forward.head

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

    def stream(
        self, prompts: list[list[int]], max_new_tokens: int | list[int] = 16, **kwargs: Any
    ) -> Iterator[TokenEvent]:
        """generate's tokens as they are chosen (generate.stream)."""
        return stream(self, prompts, max_new_tokens, **kwargs)

    def decode_loop(self, steps: int) -> DecodeLoop:
        """The loop that runs `steps` decode steps per launch over this model (xgraph.
        decode_loop), made at its first use: its graphs share the executor's memory, its
        sequences are the executor's up to max_seqs. The LM head and the token choice run
        inside the launch; with compile=..., the choice and the step feedback run compiled
        under the same torch.compile backend (xgraph.loop_step)."""
        loop = self._loops.get(steps)
        if loop is None:
            lim = self.limits
            top = self.executor.buckets.pad(lim.max_seqs) or self.executor.buckets.max
            a = PagedAttention.for_cache(self.cache, lim.max_seqs, lim.max_blocks_per_seq)
            if self._tail is None:  # one for every K: its compiled code serves them all
                self._tail = StepTail(
                    block_size=a.block_size,
                    dummy_block=a.dummy_block,
                    dummy_slot=a.dummy_slot,
                    compiler=self._compiler,
                    max_seqs=top,
                    name=f"{self.executor.name}-loop",
                )
            loop = self._loops[steps] = DecodeLoop(
                _LoopStep(self._forward),
                attention=a,
                steps=steps,
                backend=self.backend,
                buckets=[b for b in self.executor.buckets.sizes if b <= top],
                memory=self.executor.memory,
                inputs=self.inputs(),
                max_stop_ids=LOOP_STOP_IDS,
                compiled=self.compiled is not None,
                tail=self._tail,
                name=f"{self.executor.name}-loop{steps}",
            )
        return loop

    def engine(self, **kwargs: Any) -> Engine:
        """A generation loop over this model that takes requests while it runs (engine.py)."""
        return Engine(self, **kwargs)

    def stats(self) -> dict[str, Any]:
        """The executor's stats, and how the decoder is compiled ("compile": None when not
        asked, {"skipped": why} where the default scope left it uncompiled)."""
        out = self.executor.stats()
        if self.compiled is not None:
            out["compile"] = self.compiled.stats()
        else:
            out["compile"] = {"skipped": self.compile_skipped} if self.compile_skipped else None
        out["head"] = "outside the graphs" if self.head is not None else "inside the graphs"
        return out

    def close(self) -> None:
        """Close the executor; the last GraphModel over the model gives it back its own
        attention implementation. Idempotent; runs by itself when the GraphModel is
        collected."""
        self._finalizer()

    def __enter__(self) -> GraphModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
