"""GraphExecutor: bucket -> persistent buffers -> capture on miss / replay on hit.

    ex = xgraph.GraphExecutor(model.forward, inputs=[...], attention=PagedAttention(...))
    out = ex(input_ids=ids, positions=pos, attn=xgraph.AttentionInputs(...))

Per step: validate everything (nothing is written before the step is known good), pick the
kind (decode -> full graph, prefill / mixed -> piecewise), pad to the bucket, write the
persistent buffers (real prefix + declared fill), then replay the cached graph for the key
or warm up, capture and cache it. Outputs are views of one persistent output buffer sliced
to the real size, valid until the next step (`clone=True` copies).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .attention import AttentionMetadata, InlineRunner, step_context
from .buckets import Buckets, Dim, Input
from .buffers import BufferSpec, StagedBuffers
from .errors import BucketOverflowError, CaptureError, InputError, XGraphError
from .interfaces import AttentionRunner, Backend, Graph
from .memory import GraphMemory, Lease
from .piecewise import PiecewiseGraph, guarded_storages
from .plugins import get_backend

logger = logging.getLogger("xgraph")

NUM_TOKENS = "num_tokens"
KINDS = ("full", "piecewise")


class XGraphWarning(UserWarning):
    """Warnings about steps that ran eagerly instead of through a graph."""


@dataclass
class PagedAttention:
    """What the executor needs to drive `xgraph.attention` over a paged KV cache.

    Metadata buffers are sized for `max_seqs` sequences (at least the largest bucket, for
    decode) and `max_blocks_per_seq` block-table columns of `block_size` slots. Padded
    tokens write their k/v to `dummy_slot`; padded sequences point at `dummy_block` with
    seq_len 1.
    """

    max_seqs: int
    max_blocks_per_seq: int
    dummy_slot: int
    dummy_block: int
    block_size: int
    kv_tensors: Sequence[torch.Tensor] = ()
    decode_runner: AttentionRunner | None = None
    prefill_runner: AttentionRunner | None = None

    @classmethod
    def for_cache(
        cls, cache: Any, max_seqs: int, max_blocks_per_seq: int, **kwargs: Any
    ) -> PagedAttention:
        """From a cache with dummy_slot, dummy_block and tensors() (e.g. PagedKVCache)."""
        return cls(
            max_seqs=max_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            dummy_slot=cache.dummy_slot,
            dummy_block=cache.dummy_block,
            block_size=cache.block_size,
            kv_tensors=list(cache.tensors()),
            **kwargs,
        )


@dataclass
class AttentionInputs:
    """A step's attention inputs, on the host: one entry per sequence (slot_mapping per token)."""

    query_lens: Sequence[int]
    seq_lens: Sequence[int]
    block_tables: torch.Tensor | Sequence[Sequence[int]]
    slot_mapping: torch.Tensor | Sequence[int]


@dataclass
class _Entry:
    kind: str
    graph: Graph | PiecewiseGraph
    lease: Lease
    capture_seconds: float
    hits: int = 0


@dataclass
class _Step:
    """A validated step: tensors, real dim sizes, padded extents, the key."""

    kind: str  # "full" | "piecewise" | "eager"
    tensors: dict[str, torch.Tensor]
    sizes: dict[str, int]
    padded: dict[str, int] | None = None
    key: tuple | None = None
    attn: _AttnHost | None = None
    reason: str = ""


@dataclass
class _AttnHost:
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # [seqs, w] int32, cpu or device
    slot_mapping: torch.Tensor  # [tokens] int64

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)


@dataclass
class ExecutorStats:
    captures: int = 0
    replays: int = 0
    eager: Counter = field(default_factory=Counter)  # reason -> steps
    capture_seconds: float = 0.0
    failed_keys: dict[tuple, str] = field(default_factory=dict)


class GraphExecutor:
    """Runs a forward through cached graphs, one per bucket key (see the module docstring).

    Args:
        forward: the model's forward; called with the declared inputs as keyword arguments
            (views of persistent buffers, padded to the bucket) and returning a tensor, or a
            tuple / list / dict of tensors whose first dim is the padded number of tokens.
        inputs: declared inputs; shapes use "num_tokens" and the names of `dims`.
        backend: a name, a Backend, or None (XGRAPH_BACKEND, else the best available).
        buckets: num_tokens bucket sizes (a list, a Buckets, or an int maximum for the
            default policy 1, 2, 4, 8, then multiples of 16); defaults to the policy up to
            `max_tokens`.
        dims: further symbolic dims (shape-determining ones carry their own buckets).
        attention: paged-attention settings when the model calls `xgraph.attention`.
        memory: "shared-physical" (default with VMM), "shared-pool", "private", or a shared
            GraphMemory / SharedPhysicalPool.
        mode: "auto" (decode -> full graph, other batches -> piecewise), "full" (full graphs
            for decode, eager otherwise), "piecewise" (every step piecewise), "eager".
        on_overflow: "eager" (run steps above the largest bucket eagerly, logged once) or
            "raise" (BucketOverflowError).
        on_capture_error: "eager" (roll back, run that key eagerly from then on, warn once)
            or "raise" (roll back, raise CaptureError).
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        *,
        inputs: Sequence[Input],
        backend: str | Backend | None = None,
        buckets: Buckets | Sequence[int] | int | None = None,
        max_tokens: int = 512,
        dims: Sequence[Dim] = (),
        attention: PagedAttention | None = None,
        memory: object = None,
        mode: str = "auto",
        on_overflow: str = "eager",
        on_capture_error: str = "eager",
        name: str = "executor",
    ) -> None:
        if mode not in ("auto", "full", "piecewise", "eager"):
            raise XGraphError(f"mode={mode!r}: choose 'auto', 'full', 'piecewise' or 'eager'.")
        if on_overflow not in ("eager", "raise"):
            raise XGraphError(f"on_overflow={on_overflow!r}: choose 'eager' or 'raise'.")
        if on_capture_error not in ("eager", "raise"):
            raise XGraphError(f"on_capture_error={on_capture_error!r}: choose 'eager' or 'raise'.")
        self.forward = forward
        self.backend = get_backend(backend)
        self.device = self.backend.device
        self.buckets = Buckets.of(buckets, max_tokens)
        self.mode, self.on_overflow, self.on_capture_error = mode, on_overflow, on_capture_error
        self.name = name
        self.dims: dict[str, Dim] = {
            NUM_TOKENS: Dim(NUM_TOKENS, self.buckets.max, self.buckets.sizes)
        }
        for d in dims:
            if d.name in self.dims:
                raise XGraphError(f"Dim {d.name!r} is declared twice.")
            if d.pad_like is not None and d.pad_like != NUM_TOKENS:
                raise XGraphError(f"Dim {d.name!r}: pad_like supports 'num_tokens' only.")
            biggest = max(d.buckets) if d.buckets else (
                self.buckets.max if d.pad_like else d.max)
            if biggest > d.max:
                raise XGraphError(
                    f"Dim {d.name!r}: max={d.max} is below its largest padded size {biggest}; "
                    "its buffers could not hold a padded step. Raise max."
                )
            self.dims[d.name] = d
        self._dim_buckets = {n: Buckets(d.buckets) for n, d in self.dims.items() if d.in_key}
        self.inputs = list(inputs)
        if len({i.name for i in self.inputs}) != len(self.inputs):
            raise XGraphError("Input names must be unique.")
        reserved = {"attn", "clone"} & {i.name for i in self.inputs}
        if reserved:
            raise XGraphError(f"Input names {sorted(reserved)} are taken by the step call's own "
                              "arguments (attn=, clone=); rename them.")
        for i in self.inputs:
            for s in i.shape:
                if isinstance(s, str) and s not in self.dims:
                    raise XGraphError(
                        f"Input {i.name!r} uses dim {s!r}, which is not declared. Declared: "
                        f"{sorted(self.dims)}; add Dim({s!r}, max=...) to dims=."
                    )
        self.attention = attention
        if attention is not None:
            runners = self.backend.attention_runners()
            self.decode_runner = attention.decode_runner or runners["decode"]
            self.prefill_runner = attention.prefill_runner or runners["prefill"]
            self._guarded = guarded_storages(attention.kv_tensors)
            if mode in ("auto", "full") and not self.decode_runner.graph_safe:
                raise XGraphError(
                    f"{type(self.decode_runner).__name__} is not graph-safe, so decode cannot "
                    f"run as a full graph (mode={mode!r}). Pass a graph-safe decode_runner, or "
                    "use mode='piecewise'."
                )
        self.memory = GraphMemory.of(self.backend, memory)
        self._owns_memory = not isinstance(memory, GraphMemory)
        self._graphs: dict[tuple, _Entry] = {}
        self._eager_keys: dict[tuple, str] = {}
        self._out_bufs: list[torch.Tensor] | None = None
        self._out_spec: Any = None
        self._warned_overflow = False
        self._stats = ExecutorStats()
        self._closed = False
        self._alloc_buffers()

    # -- persistent buffers ----------------------------------------------------------------

    def _alloc_buffers(self) -> None:
        specs = [
            BufferSpec(i.name, i.dtype,  # type: ignore[arg-type]
                       tuple(self.dims[s].max if isinstance(s, str) else int(s) for s in i.shape),
                       i.fill)
            for i in self.inputs
        ]
        a = self.attention
        if a is not None:
            t, s = self.buckets.max, max(a.max_seqs, self.buckets.max)
            # block tables last: a step's copy to the device then ends at its used rows
            specs += [
                BufferSpec("slot_mapping", torch.int64, (t,), a.dummy_slot),
                BufferSpec("seq_lens", torch.int32, (s,), 1),
                BufferSpec("query_start_loc", torch.int32, (s + 1,), 0),
                BufferSpec("block_tables", torch.int32, (s, a.max_blocks_per_seq),
                           a.dummy_block),
            ]
            self._max_seqs = s
        self._staged = StagedBuffers(specs, self.device)
        self._buf = {i.name: self._staged[i.name] for i in self.inputs}

    def persistent_bytes(self) -> int:
        """Bytes of every persistent buffer (inputs, attention metadata, outputs)."""
        n = sum(v.numel() * v.element_size() for _, v in self._staged.items())
        return n + sum(b.numel() * b.element_size() for b in self._out_bufs or [])

    # -- validation ------------------------------------------------------------------------

    def _validate(self, inputs: Mapping[str, Any], attn: AttentionInputs | None) -> _Step:
        names = {i.name for i in self.inputs}
        missing, unknown = names - set(inputs), set(inputs) - names
        if missing or unknown:
            raise InputError(
                f"{self.name}: inputs {sorted(inputs)} do not match the declared inputs "
                f"{sorted(names)} (missing {sorted(missing)}, unknown {sorted(unknown)})."
            )
        sizes: dict[str, int] = {}
        tensors: dict[str, torch.Tensor] = {}
        for spec in self.inputs:
            v = inputs[spec.name]
            if not isinstance(v, torch.Tensor):
                raise InputError(
                    f"{self.name}: input {spec.name!r} must be a torch.Tensor, got "
                    f"{type(v).__name__}."
                )
            if v.dtype != spec.dtype:
                raise InputError(
                    f"{self.name}: input {spec.name!r} has dtype {v.dtype}, declared "
                    f"{spec.dtype}; convert it with .to({spec.dtype})."
                )
            if v.device.type != "cpu" and v.device != self.device:
                raise InputError(
                    f"{self.name}: input {spec.name!r} is on {v.device}; the executor runs on "
                    f"{self.device}. Pass host tensors or tensors on {self.device}."
                )
            if v.dim() != len(spec.shape):
                raise InputError(
                    f"{self.name}: input {spec.name!r} has shape {tuple(v.shape)}, "
                    f"declared {spec.shape} ({len(spec.shape)} dims)."
                )
            for axis, (n, s) in enumerate(zip(v.shape, spec.shape)):
                if isinstance(s, int):
                    if n != s:
                        raise InputError(
                            f"{self.name}: input {spec.name!r} dim {axis} is {n}, declared {s}."
                        )
                    continue
                if sizes.setdefault(s, n) != n:
                    raise InputError(
                        f"{self.name}: dim {s!r} is {sizes[s]} in one input and {n} in "
                        f"{spec.name!r}; every input must agree on it."
                    )
                if s != NUM_TOKENS and not self.dims[s].in_key and n > self.dims[s].max:
                    raise InputError(
                        f"{self.name}: dim {s!r} is {n}, above its max {self.dims[s].max}."
                    )
            tensors[spec.name] = v
        if NUM_TOKENS not in sizes:
            raise InputError(f"{self.name}: no input has a 'num_tokens' dim.")
        step = _Step("eager", tensors, sizes)
        if self.attention is not None:
            if attn is None:
                raise InputError(
                    f"{self.name}: this executor drives attention; pass "
                    "attn=xgraph.AttentionInputs(...)."
                )
            step.attn = self._validate_attn(attn, sizes[NUM_TOKENS])
        elif attn is not None:
            raise InputError(f"{self.name}: attn= was given but the executor has no attention=.")
        return step

    def _validate_attn(self, attn: AttentionInputs, num_tokens: int) -> _AttnHost:
        a = self.attention
        assert a is not None
        ql, sl = [int(x) for x in attn.query_lens], [int(x) for x in attn.seq_lens]
        n = len(ql)
        if len(sl) != n:
            raise InputError(f"{self.name}: {n} query_lens but {len(sl)} seq_lens.")
        if sum(ql) != num_tokens:
            raise InputError(
                f"{self.name}: query_lens sum to {sum(ql)}, but the inputs have "
                f"{num_tokens} tokens."
            )
        if any(q < 1 or q > s for q, s in zip(ql, sl)):
            raise InputError(
                f"{self.name}: every sequence needs 1 <= query_len <= seq_len; got "
                f"query_lens={ql}, seq_lens={sl}."
            )
        if n > self._max_seqs:
            raise InputError(f"{self.name}: {n} sequences, above max_seqs={self._max_seqs}.")
        bt = attn.block_tables
        if not isinstance(bt, torch.Tensor):
            bt = _ragged_rows(bt, a.dummy_block)
        if bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != n:
            raise InputError(
                f"{self.name}: block_tables must be int32 [num_seqs={n}, width]; "
                f"got {bt.dtype} {tuple(bt.shape)}."
            )
        if bt.shape[1] > a.max_blocks_per_seq:
            raise InputError(
                f"{self.name}: block_tables width {bt.shape[1]} is above "
                f"max_blocks_per_seq={a.max_blocks_per_seq}."
            )
        sm = attn.slot_mapping
        if not isinstance(sm, torch.Tensor):
            sm = torch.tensor(list(sm), dtype=torch.int64)
        if sm.dtype != torch.int64 or tuple(sm.shape) != (num_tokens,):
            raise InputError(
                f"{self.name}: slot_mapping must be int64 [{num_tokens}]; got "
                f"{sm.dtype} {tuple(sm.shape)}."
            )
        for t in (bt, sm):
            if t.device.type != "cpu" and t.device != self.device:
                raise InputError(
                    f"{self.name}: attention inputs must be on the host or on "
                    f"{self.device}; got {t.device}."
                )
        return _AttnHost(ql, sl, bt, sm)

    # -- keys ------------------------------------------------------------------------------

    def _classify(self, step: _Step) -> _Step:
        """Choose the kind (full / piecewise / eager) and the key; above buckets: policy."""
        if self.mode == "eager":
            step.kind, step.reason = "eager", "mode"
            return step
        if step.attn is None or step.attn.is_decode:
            kind = "piecewise" if self.mode == "piecewise" else "full"
        elif self.mode in ("auto", "piecewise"):
            kind = "piecewise"
        else:
            step.kind, step.reason = "eager", "not decode (mode='full')"
            return step
        padded: dict[str, int] = {}
        for name, b in self._dim_buckets.items():
            if name not in step.sizes:
                continue
            p = b.pad(step.sizes[name])
            if p is None:
                return self._overflow(step, name, b.max)
            padded[name] = p
        for name, d in self.dims.items():
            if d.pad_like is not None and name in step.sizes:
                padded[name] = padded[d.pad_like]
                if step.sizes[name] > padded[name]:
                    raise InputError(
                        f"{self.name}: dim {name!r} ({step.sizes[name]}) exceeds "
                        f"the {d.pad_like} bucket {padded[name]} it is padded like."
                    )
        step.kind, step.padded = kind, padded
        # piecewise pieces never see sequence-shaped data, so the batch composition is not
        # part of their key; a full graph bakes it in through the padded sequence count
        step.key = (kind, *(padded[n] for n in self._dim_buckets if n in padded))
        return step

    def _overflow(self, step: _Step, dim: str, largest: int) -> _Step:
        n = step.sizes[dim]
        if self.on_overflow == "raise":
            raise BucketOverflowError(
                f"{self.name}: {dim}={n} is above the largest bucket {largest}. Raise the "
                "largest bucket, split the batch, or use on_overflow='eager'."
            )
        if not self._warned_overflow:
            self._warned_overflow = True
            logger.warning(
                "%s: %s=%d is above the largest bucket %d; running such steps "
                "eagerly (on_overflow='eager'). Shown once.",
                self.name,
                dim,
                n,
                largest,
            )
        step.kind, step.reason = "eager", "above largest bucket"
        return step

    # -- step ------------------------------------------------------------------------------

    def __call__(
        self, attn: AttentionInputs | None = None, clone: bool = False, **inputs: torch.Tensor
    ) -> Any:
        """Run one step; returns the forward's outputs sliced to the real number of tokens."""
        if self._closed:
            raise XGraphError(f"{self.name} is closed.")
        step = self._classify(self._validate(inputs, attn))
        if step.kind == "eager":
            out = self._run_unpadded(step)
        else:
            views, md = self._stage(step)
            key = step.key
            entry = self._graphs.get(key)  # type: ignore[arg-type]
            if entry is not None:
                self._replay(entry, md)
                out = self._outputs(step.sizes[NUM_TOKENS])
            elif key in self._eager_keys:
                out = self._run_padded(step, views, md, "capture failed earlier")
            else:
                out = self._capture(step, views, md)
        if clone:
            flat, spec = tree_flatten(out)
            out = tree_unflatten([t.clone() for t in flat], spec)
        return out

    def _stage(self, step: _Step) -> tuple[dict[str, torch.Tensor], AttentionMetadata | None]:
        """Write the step into the persistent buffers; return views padded to the key."""
        assert step.padded is not None
        padded = step.padded
        st = self._staged
        st.begin()
        views = {}
        for spec in self.inputs:
            extent = [
                int(s) if isinstance(s, int) else padded.get(s, self.dims[s].max)
                for s in spec.shape
            ]
            views[spec.name] = st.write(spec.name, step.tensors[spec.name], extent)
        md = None
        if step.attn is not None:
            md = self._stage_attention(step, padded[NUM_TOKENS])
        st.flush()
        return views, md

    def _stage_attention(self, step: _Step, tb: int) -> AttentionMetadata:
        a, h, st = self.attention, step.attn, self._staged
        assert a is not None and h is not None
        t, n = step.sizes[NUM_TOKENS], len(h.query_lens)
        full = step.kind == "full"
        b = tb if full else n  # a full graph sees the padded sequence count
        pad = b - n
        ql, sl = h.query_lens + [1] * pad, h.seq_lens + [1] * pad
        qsl = [0, *itertools.accumulate(ql)]
        return AttentionMetadata(
            slot_mapping=st.write("slot_mapping", h.slot_mapping, (tb,)),
            seq_lens=st.write("seq_lens", torch.tensor(sl, dtype=torch.int32), (b,)),
            query_start_loc=st.write("query_start_loc", torch.tensor(qsl, dtype=torch.int32),
                                     (b + 1,)),
            block_tables=st.write("block_tables", h.block_tables, (b, a.max_blocks_per_seq)),
            num_tokens=tb if full else t,
            num_seqs=b,
            query_lens_host=ql,
            seq_lens_host=sl,
        )

    def _runner(self, kind: str) -> AttentionRunner:
        return self.decode_runner if kind == "full" else self.prefill_runner

    def _replay(self, entry: _Entry, md: AttentionMetadata | None, hit: bool = True) -> None:
        entry.hits += hit
        self._stats.replays += 1
        runner = None
        if md is not None:
            runner = self._runner(entry.kind)
            runner.plan(md)
        if isinstance(entry.graph, PiecewiseGraph):
            entry.graph.replay(runner)  # type: ignore[arg-type]
        else:
            entry.graph.replay()

    def _outputs(self, n: int) -> Any:
        assert self._out_bufs is not None
        return tree_unflatten([b[:n] for b in self._out_bufs], self._out_spec)

    # -- eager paths -----------------------------------------------------------------------

    def _eager_forward(
        self, views: Mapping[str, torch.Tensor], md: AttentionMetadata | None, kind: str
    ) -> Any:
        with torch.no_grad():
            if md is None:
                return self.forward(**views)
            runner = self._runner(kind)
            runner.plan(md)
            with step_context(InlineRunner(runner)):
                return self.forward(**views)

    def _run_unpadded(self, step: _Step) -> Any:
        """Eager on the step's own tensors (above the largest bucket, or mode='eager')."""
        self._stats.eager[step.reason] += 1
        views = {k: v.to(self.device) for k, v in step.tensors.items()}
        md = None
        kind = "piecewise"
        if step.attn is not None:
            h = step.attn
            md = AttentionMetadata.build(
                h.query_lens, h.seq_lens, h.block_tables, h.slot_mapping, self.device
            )
            kind = "full" if h.is_decode else "piecewise"
        return self._eager_forward(views, md, kind)

    def _run_padded(
        self, step: _Step, views: dict[str, torch.Tensor], md: AttentionMetadata | None, reason: str
    ) -> Any:
        """Eager on the padded buffers (a key whose capture failed)."""
        self._stats.eager[reason] += 1
        out = self._eager_forward(views, md, step.kind)
        flat, spec = tree_flatten(out)
        n = step.sizes[NUM_TOKENS]
        return tree_unflatten([t[:n] for t in flat], spec)

    # -- capture ---------------------------------------------------------------------------

    def _ensure_out_buffers(self, result: Any, tb: int) -> list[torch.Tensor]:
        flat, spec = tree_flatten(result)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != tb:
                raise XGraphError(
                    f"{self.name}: every forward output must be a tensor whose first dim is the "
                    f"padded number of tokens ({tb}); got {type(t).__name__} "
                    f"{tuple(getattr(t, 'shape', ()))}."
                )
        if self._out_bufs is None:
            m = self.buckets.max
            self._out_bufs = [
                torch.empty((m, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in flat
            ]
            self._out_spec = spec
        elif spec != self._out_spec or any(
            b.shape[1:] != t.shape[1:] or b.dtype != t.dtype for b, t in zip(self._out_bufs, flat)
        ):
            raise XGraphError(
                f"{self.name}: the forward's outputs changed structure, shape or "
                "dtype between buckets; they must stay the same."
            )
        return flat

    def _copy_out(self, result: Any, tb: int) -> None:
        assert self._out_bufs is not None
        for buf, t in zip(self._out_bufs, tree_flatten(result)[0]):
            buf[:tb].copy_(t)

    def _capture(
        self, step: _Step, views: dict[str, torch.Tensor], md: AttentionMetadata | None
    ) -> Any:
        assert step.padded is not None and step.key is not None
        tb, kind, key = step.padded[NUM_TOKENS], step.kind, step.key
        t0 = time.perf_counter()
        # warm-up: the forward runs eagerly once (lazy init, autotuning, workspaces) and its
        # outputs fix the persistent output buffers
        with self.backend.warmup_context():
            warm = self._eager_forward(views, md, kind)
            self._ensure_out_buffers(warm, tb)
        del warm
        self.backend.synchronize()
        lease = self.memory.begin()
        graph: Graph | PiecewiseGraph | None = None
        try:
            with torch.no_grad():
                if kind == "full":
                    graph = self.backend.new_graph()
                    ctx = (
                        InlineRunner(self.decode_runner, require_graph_safe=True)
                        if md is not None
                        else None
                    )
                    graph.capture_begin(lease.pool)
                    if ctx is None:
                        result = self.forward(**views)
                    else:
                        with step_context(ctx):
                            result = self.forward(**views)
                    self._ensure_out_buffers(result, tb)
                    self._copy_out(result, tb)
                    del result
                    graph.capture_end()
                else:
                    graph = PiecewiseGraph(
                        self.backend, lease.pool, getattr(self, "_guarded", set())
                    )
                    if md is not None:
                        self.prefill_runner.plan(md)
                    graph.begin_piece()
                    with step_context(graph):
                        result = self.forward(**views)
                    self._ensure_out_buffers(result, tb)
                    self._copy_out(result, tb)
                    del result
                    graph.end_piece()
        except Exception as exc:
            if graph is not None:
                graph.abort()
            self.memory.rollback(lease)
            return self._capture_failed(step, views, md, exc)
        seconds = time.perf_counter() - t0
        entry = _Entry(kind, graph, lease, seconds)
        self._graphs[key] = entry
        self._stats.captures += 1
        self._stats.capture_seconds += seconds
        logger.info("%s: captured %s in %.3f s", self.name, key, seconds)
        self._replay(entry, md, hit=False)  # the capture step's own result
        return self._outputs(step.sizes[NUM_TOKENS])

    def _capture_failed(
        self,
        step: _Step,
        views: dict[str, torch.Tensor],
        md: AttentionMetadata | None,
        exc: Exception,
    ) -> Any:
        key = step.key
        assert key is not None
        reason = f"{type(exc).__name__}: {exc}"
        self._stats.failed_keys[key] = reason
        if self.on_capture_error == "raise":
            if isinstance(exc, CaptureError):
                raise exc
            raise CaptureError(
                f"{self.name}: capturing {key} failed ({reason}). Nothing was kept; fix the "
                "model or use on_capture_error='eager'."
            ) from exc
        self._eager_keys[key] = reason
        msg = (
            f"{self.name}: capturing {key} failed and was rolled back; this key runs eagerly "
            f"from now on (on_capture_error='eager'). Cause: {reason}"
        )
        warnings.warn(msg, XGraphWarning, stacklevel=4)  # the engine's step call
        logger.warning(msg)
        return self._run_padded(step, views, md, "capture failed")

    # -- pre-capture -----------------------------------------------------------------------

    def capture(
        self,
        sizes: Iterable[int] | None = None,
        kind: str = "full",
        progress: bool = True,
        **key_dims: int,
    ) -> None:
        """Capture graphs before serving: one per num_tokens size, in the order given.

        Default: every bucket, largest first (what a shared native pool needs). Each capture
        runs on a synthetic step that touches only the dummy slot and block; `key_dims` fix
        the sizes of other shape-determining dims.
        """
        if kind not in KINDS:
            raise XGraphError(f"kind={kind!r}: choose 'full' or 'piecewise'.")
        todo = list(sizes) if sizes is not None else sorted(self.buckets.sizes, reverse=True)
        bar = _progress(todo, f"{self.name}: capturing {kind} graphs", progress)
        saved = self.mode
        self.mode = "piecewise" if kind == "piecewise" else "auto"
        try:
            for n in bar:
                self(**self._synthetic_step(n, key_dims))
        finally:
            self.mode = saved

    def _synthetic_step(self, n: int, key_dims: Mapping[str, int]) -> dict[str, Any]:
        sizes = {NUM_TOKENS: n, **key_dims}
        for name, d in self.dims.items():
            sizes.setdefault(
                name, n if d.pad_like == NUM_TOKENS else (d.buckets[0] if d.buckets else 1)
            )
        kwargs: dict[str, Any] = {}
        for spec in self.inputs:
            shape = [s if isinstance(s, int) else sizes[s] for s in spec.shape]
            kwargs[spec.name] = torch.full(shape, spec.fill, dtype=spec.dtype)  # type: ignore[arg-type]
        if self.attention is not None:
            kwargs["attn"] = self._synthetic_attention(n, decode=self.mode != "piecewise")
        return kwargs

    def _synthetic_attention(self, n: int, decode: bool) -> AttentionInputs:
        """Attention inputs that touch only the dummy slot and block.

        Decode: n single-token sequences. Piecewise: as few sequences as the block-table
        width allows (runners planned on the host cost per sequence); their context is the
        dummy block repeated, every token writes the dummy slot.
        """
        a = self.attention
        assert a is not None
        if decode:
            return AttentionInputs([1] * n, [1] * n, [[a.dummy_block]] * n, [a.dummy_slot] * n)
        per_seq = a.max_blocks_per_seq * a.block_size
        lens = [per_seq] * (n // per_seq) + ([n % per_seq] if n % per_seq else [])
        tables = [[a.dummy_block] * -(-q // a.block_size) for q in lens]
        return AttentionInputs(lens, lens, tables, [a.dummy_slot] * n)

    # -- reporting and teardown ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Captures, replays, eager steps by reason, capture seconds, hits per key, bytes."""
        s = self._stats
        return {
            "captures": s.captures,
            "replays": s.replays,
            "eager": dict(s.eager),
            "capture_seconds": s.capture_seconds,
            "hits": {k: e.hits for k, e in self._graphs.items()},
            "eager_keys": dict(self._eager_keys),
            "failed_keys": dict(s.failed_keys),
            "persistent_bytes": self.persistent_bytes(),
            "graph_bytes": self.memory.graph_bytes(),
            "memory": self.memory.stats(),
            "keys": sorted(self._graphs, key=repr),
        }

    def graph(self, key: tuple) -> Graph | PiecewiseGraph | None:
        e = self._graphs.get(key)
        return e.graph if e else None

    def close(self) -> None:
        """Reset every graph, then give back graph memory (if this executor owns it)."""
        if self._closed:
            return
        self._closed = True
        for e in self._graphs.values():
            e.graph.reset()
        self._graphs.clear()
        if self._owns_memory:
            self.memory.close()

    def __enter__(self) -> GraphExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ragged_rows(rows: Sequence[Sequence[int]], fill: int) -> torch.Tensor:
    """Lists of block ids of different lengths -> int32 [rows, longest], padded with fill."""
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    width = int(lens.max()) if len(rows) else 0
    out = torch.full((len(rows), width), fill, dtype=torch.int32)
    if width:
        flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int32)
        out[torch.arange(width)[None, :] < lens[:, None]] = flat
    return out


def _progress(items: list[int], desc: str, enabled: bool) -> Iterable[int]:
    """tqdm when installed and wanted; otherwise a log line every tenth of the way."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(items, desc=desc, unit="graph", leave=False)
        except ImportError:
            pass

    def logged() -> Iterable[int]:
        step = max(1, math.ceil(len(items) / 10))
        for i, n in enumerate(items):
            if i % step == 0:
                logger.info("%s: %d/%d", desc, i, len(items))
            yield n

    return logged()
