"""The step planner: one `plan()` per step validates, classifies, buckets and stages it.

    step = planner.plan(inputs, attn)   # Kind.FULL / PIECEWISE with a key and staged views,
                                        # or Kind.EAGER with the reason

One path for every step: the token inputs are checked (`xgraph.validation`), the attention
inputs normalized and checked (`xgraph.step_attention`), the kind and key chosen here, and
the step written into the persistent buffers (`xgraph.staging`, padded by
`xgraph.padding`). Nothing is written before the step is known good.

Classification: decode steps (one token per sequence, or no attention) run as full graphs,
other steps piecewise, as the mode allows. Bucketing pads every shape-determining dim to
its bucket (dims declared `pad_like` follow num_tokens), or to at least the sizes a caller
forces (`pad_to`: ranks that agreed on a key); a step above the largest bucket runs eagerly
or raises, by policy.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .buckets import Buckets, Dim, Input
from .buffers import BufferSpec, CopierFactory, StagedBuffers
from .device_check import COUNTS, DeviceCheck
from .errors import BucketOverflowError, InputError, XGraphError, XGraphWarning
from .interfaces import AttentionRunner
from .metadata import AttentionInputs, AttentionMetadata
from .options import Fallback, Kind, Mode
from .paging import PagedAttention
from .staging import StepStaging
from .step_attention import AttentionCheck, StepAttention
from .validation import NUM_TOKENS, TokenCheck

if TYPE_CHECKING:
    from .lifetime import Holdings

logger = logging.getLogger("xgraph")


@dataclass
class Step:
    """A validated step: its tensors, real dim sizes, and (graph kinds) key, padding and views."""

    kind: Kind
    tensors: dict[str, torch.Tensor]
    sizes: dict[str, int]
    attn: StepAttention | None = None
    key: tuple | None = None
    padded: dict[str, int] = field(default_factory=dict)
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: AttentionMetadata | None = None
    reason: str = ""  # why it runs eagerly

    @property
    def num_tokens(self) -> int:
        return self.sizes[NUM_TOKENS]


def declare_dims(name: str, buckets: Buckets, dims: Sequence[Dim]) -> dict[str, Dim]:
    """num_tokens plus the declared dims, refused if inconsistent."""
    out = {NUM_TOKENS: Dim(NUM_TOKENS, buckets.max, buckets.sizes)}
    for d in dims:
        if d.name in out:
            raise XGraphError(f"{name}: Dim {d.name!r} is declared twice.")
        if d.pad_like is not None and d.pad_like != NUM_TOKENS:
            raise XGraphError(f"{name}: Dim {d.name!r}: pad_like supports 'num_tokens' only.")
        biggest = max(d.buckets) if d.buckets else (buckets.max if d.pad_like else d.max)
        if biggest > d.max:
            raise XGraphError(
                f"Dim {d.name!r}: max={d.max} is below its largest padded size {biggest}; "
                "its buffers could not hold a padded step. Raise max."
            )
        out[d.name] = d
    return out


def check_inputs(name: str, inputs: Sequence[Input], dims: Mapping[str, Dim]) -> None:
    """Input names unique, not the step call's own, and every symbolic dim declared."""
    names = [i.name for i in inputs]
    if len(set(names)) != len(names):
        raise XGraphError(f"{name}: input names must be unique; got {names}.")
    reserved = {"attn", "clone"} & set(names)
    if reserved:
        raise XGraphError(
            f"Input names {sorted(reserved)} are taken by the step call's own arguments "
            "(attn=, clone=); rename them."
        )
    for i in inputs:
        for s in i.shape:
            if isinstance(s, str) and s not in dims:
                raise XGraphError(
                    f"Input {i.name!r} uses dim {s!r}, which is not declared. Declared: "
                    f"{sorted(dims)}; add Dim({s!r}, max=...) to dims=."
                )


class _Overflow(Exception):
    """A key dim above its largest bucket (raised while padding, handled by the policy)."""

    def __init__(self, dim: str, largest: int) -> None:
        self.dim, self.largest = dim, largest


class StepPlanner:
    """Turns a step call into a planned Step over the executor's persistent buffers."""

    def __init__(
        self,
        name: str,
        *,
        inputs: Sequence[Input],
        dims: Sequence[Dim],
        buckets: Buckets,
        attention: PagedAttention | None,
        device: torch.device,
        mode: Mode,
        on_overflow: Fallback,
        copier: CopierFactory | None = None,
        decode_runner: AttentionRunner | None = None,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """`decode_runner`: the full graphs' runner, which must serve the attention's
        `max_query_len` (steps of one query length per sequence run as full graphs up to
        it; 1: decode steps only). `allocate(nbytes)`: where the packed device buffer lives
        (xgraph.buffers.StagedBuffers)."""
        self.name, self.device, self.mode, self.on_overflow = name, device, mode, on_overflow
        self.buckets = buckets
        self.dims = declare_dims(name, buckets, dims)
        self.inputs = list(inputs)
        check_inputs(name, self.inputs, self.dims)
        self.attention = attention
        self.key_buckets = {n: Buckets(d.buckets) for n, d in self.dims.items() if d.buckets}
        self.pad_like = [n for n, d in self.dims.items() if d.pad_like is not None]
        self.tokens_only_key = list(self.key_buckets) == [NUM_TOKENS] and not self.pad_like
        # (forced kind, num_tokens, q) -> (kind, key, padded sizes), where nothing else
        # decides them (no pad_to, num_tokens the only key dim)
        self._simple: dict[tuple[Kind | None, int, int], tuple[Kind, tuple, dict[str, int]]] = {}
        self.full_query_len = attention.max_query_len if attention else 1
        if decode_runner is not None and self.full_query_len > decode_runner.max_query_len:
            raise XGraphError(
                f"PagedAttention(max_query_len={self.full_query_len}): the decode runner "
                f"{type(decode_runner).__name__} serves full graphs of up to "
                f"{decode_runner.max_query_len} tokens per sequence. Lower max_query_len or "
                "pass a runner that serves it."
            )
        self.maxima = {n: d.max for n, d in self.dims.items()}
        self.max_seqs = max(attention.max_seqs, buckets.max) if attention is not None else 0
        self.closed = False
        self._staged = StagedBuffers(self._buffer_specs(), device, copier, allocate)
        sizes = (self.max_seqs, buckets.max)  # a full graph's most sequences and tokens
        self.device_check = (
            DeviceCheck(name, attention, device, self._staged[COUNTS], sizes, allocate)
            if attention
            else None
        )
        self.staging = StepStaging(
            self._staged, self.inputs, attention, self.maxima, self.device_check
        )
        self.tokens = TokenCheck(name, self.inputs, self.dims, device, self.staging.numpy_ok)
        self.attn_check = (
            AttentionCheck(name, attention, self.max_seqs, device) if attention else None
        )
        self._warned_overflow = False

    @property
    def staged(self) -> StagedBuffers:
        """The persistent buffers (refused once closed: their memory is given back)."""
        if self.closed:
            raise self._closed_error()
        return self._staged

    def close(self) -> None:
        """Its executor closed and gives the buffers' memory back: planning, staging and
        reading the buffers raise XGraphError from now on (idempotent)."""
        self.closed = True

    def _closed_error(self) -> XGraphError:
        return XGraphError(f"{self.name} is closed; create a new executor.")

    def _buffer_specs(self) -> list[BufferSpec]:
        specs = [
            BufferSpec(
                i.name,
                i.dtype,  # type: ignore[arg-type]  # Input keeps dtype loose
                tuple(self.dims[s].max if isinstance(s, str) else int(s) for s in i.shape),
                i.fill,
            )
            for i in self.inputs
        ]
        a = self.attention
        if a is not None:
            t, s = self.buckets.max, self.max_seqs
            # block tables last: a step's copy to the device then ends at its used rows
            specs += [
                BufferSpec(COUNTS, torch.int64, (2,), 0),
                BufferSpec("slot_mapping", torch.int64, (t,), a.dummy_slot),
                BufferSpec("seq_lens", torch.int32, (s,), 1),
                BufferSpec("query_start_loc", torch.int32, (s + 1,), 0),
                BufferSpec("block_tables", torch.int32, (s, a.max_blocks_per_seq), a.dummy_block),
            ]
        return specs

    # -- plan ------------------------------------------------------------------------------

    def plan(
        self,
        inputs: Mapping[str, Any],
        attn: AttentionInputs | None,
        kind: Kind | None = None,
        pad_to: Mapping[str, int] | None = None,
        synthetic: bool = False,
    ) -> Step:
        """Validate, classify, bucket and stage one step. `kind` forces the graph kind;
        `pad_to` pads key dims to at least these sizes (ranks agreeing on one key; a key dim
        no input uses, such as a communication dim, joins the key at its padded size);
        `synthetic` marks the executor's own pre-capture steps (dummy block only)."""
        if self.closed:
            raise self._closed_error()
        dc = self.device_check
        if dc is not None and dc.pending:
            dc.raise_pending()  # what an earlier step's device-side check found
        tokens = self.tokens.check(inputs)
        h = self._attention(attn, tokens.num_tokens, synthetic)
        step = Step(Kind.EAGER, tokens.tensors, tokens.sizes, attn=h)
        self._classify(step, kind, pad_to, synthetic)
        if h is not None and h.on_device and step.kind is not Kind.FULL:
            # host-planned runners and eager steps read the lengths on the host: copied
            # there (a sync) and checked like host metadata
            assert self.attn_check is not None
            h = step.attn = self.attn_check.check(h.on_host(), step.num_tokens, synthetic, True)
        if step.kind is Kind.EAGER:
            if h is not None:
                step.metadata = h.metadata(self.device)
            return step
        seqs = 0
        if h is not None:  # a full graph sees the padded sequence count
            full = step.kind is Kind.FULL
            seqs = step.padded[NUM_TOKENS] // h.query_len if full else h.num_seqs
        step.views, step.metadata = self.staging.stage(
            step.key, step.padded, step.tensors, tokens.arrays, h, seqs
        )
        return step

    def raise_pending(self, wait: bool = False) -> None:
        """Raise what the device-side check of an earlier step found (`wait`: for it)."""
        if self.device_check is not None:
            self.device_check.raise_pending(wait)

    def attach(self, held: Holdings) -> None:
        """The executor's holdings: the device check captures on its backend and graph
        memory, and its graphs are reset when they are released."""
        if self.device_check is not None:
            self.device_check.attach(held.backend, held.memory)
            held.closers.append(self.device_check.release)

    def persistent_bytes(self) -> int:
        """Bytes of the staged buffers and of the device check's raw buffers."""
        n = sum(v.nbytes for _, v in self._staged.items())
        return n + (self.device_check.nbytes() if self.device_check is not None else 0)

    def _attention(
        self, attn: AttentionInputs | None, num_tokens: int, synthetic: bool
    ) -> StepAttention | None:
        if self.attn_check is None:
            if attn is not None:
                raise InputError(
                    f"{self.name}: attn= was given but the executor has no attention=."
                )
            return None
        if attn is None:
            raise InputError(
                f"{self.name}: this executor drives attention; pass "
                "attn=xgraph.AttentionInputs(...)."
            )
        return self.attn_check.check(attn, num_tokens, synthetic)

    def _classify(
        self, step: Step, forced: Kind | None, pad_to: Mapping[str, int] | None, synthetic: bool
    ) -> None:
        """Choose the kind and the key; above the buckets: the overflow policy."""
        h = step.attn
        q = 1 if h is None else h.query_len
        if pad_to is None:  # where nothing but the kind, num_tokens and q decide: kept
            got = self._simple.get((forced, step.num_tokens, q))
            if got is not None:
                step.kind, step.key, step.padded = got
                return
        uniform = 1 <= q <= self.full_query_len  # a full graph can run it
        if forced is Kind.EAGER:
            step.reason = "warm-up" if synthetic else "forced"
            return
        if forced is not None:
            if forced is Kind.FULL and not uniform:
                raise InputError(
                    f"{self.name}: kind='full' was forced for a step whose query lengths "
                    f"{'differ' if not q else f'are {q}'}; the decode runner's full graphs run "
                    f"steps of one query length up to {self.full_query_len}. Force 'piecewise'."
                )
            kind = forced
        elif self.mode is Mode.EAGER:
            step.reason = "mode"
            return
        elif uniform:
            kind = Kind.PIECEWISE if self.mode is Mode.PIECEWISE else Kind.FULL
        elif self.mode is Mode.FULL:
            step.reason = "not decode (mode='full')"
            return
        else:
            kind = Kind.PIECEWISE
        if kind is Kind.FULL and q > 1 and self._sequences(step, q, pad_to) is None:
            if forced is Kind.FULL or self.mode is Mode.FULL:
                self._overflow(step, NUM_TOKENS, self.buckets.max, pad_to, q)
                return
            kind = Kind.PIECEWISE  # a piecewise graph serves it, at other padded sizes
        try:
            step.key, step.padded = self._key(step, kind, q if kind is Kind.FULL else 1, pad_to)
        except _Overflow as o:
            self._overflow(step, o.dim, o.largest, pad_to)
            return
        step.kind = kind
        if self.tokens_only_key and pad_to is None:
            self._simple[(forced, step.num_tokens, q)] = (kind, step.key, step.padded)

    def _sequences(self, step: Step, q: int, pad_to: Mapping[str, int] | None) -> int | None:
        """The padded sequence count of a full graph of query length q > 1 (a bucket, q
        tokens each, within the largest bucket), or None where it does not fit."""
        assert step.attn is not None
        want = -(-pad_to.get(NUM_TOKENS, 0) // q) if pad_to else 0
        sb = self.buckets.pad(max(step.attn.num_seqs, want))
        return sb if sb is not None and sb * q <= self.buckets.max else None

    def _key(
        self, step: Step, kind: Kind, q: int, pad_to: Mapping[str, int] | None
    ) -> tuple[tuple, dict[str, int]]:
        """(key, padded sizes) of a step of this kind and (full graphs) query length."""
        padded = self._pad(step, q, pad_to)
        # piecewise pieces never see sequence-shaped data, so the batch composition is not
        # part of their key; a full graph bakes it in through the padded sequence count, and
        # a step of several tokens per sequence (q > 1) through q as well
        key = (kind.value, *[padded[n] for n in self.key_buckets if n in padded])
        if q > 1:
            key += (q,)
        return key, padded

    def _pad(self, step: Step, q: int, pad_to: Mapping[str, int] | None) -> dict[str, int]:
        """The padded size of every key dim the step uses or `pad_to` names (_Overflow:
        above the buckets)."""
        if pad_to:
            unknown = set(pad_to) - set(self.key_buckets)
            if unknown:
                raise InputError(
                    f"{self.name}: pad_to names {sorted(unknown)}, which are not key dims; "
                    f"give sizes for {sorted(self.key_buckets)}."
                )
        padded: dict[str, int] = {}
        if q > 1:
            padded[NUM_TOKENS] = q * (self._sequences(step, q, pad_to) or 0)
        for name, b in self.key_buckets.items():
            if name in padded or (name not in step.sizes and not (pad_to and name in pad_to)):
                continue
            n = step.sizes.get(name, 0)
            p = b.pad(max(n, pad_to.get(name, 0)) if pad_to else n)
            if p is None:
                raise _Overflow(name, b.max)
            padded[name] = p
        for name in self.pad_like:
            if name in step.sizes:
                padded[name] = padded[NUM_TOKENS]
                if step.sizes[name] > padded[name]:
                    raise InputError(
                        f"{self.name}: dim {name!r} ({step.sizes[name]}) exceeds the "
                        f"num_tokens bucket {padded[name]} it is padded like."
                    )
        return padded

    def _overflow(
        self, step: Step, dim: str, largest: int, pad_to: Mapping[str, int] | None, q: int = 1
    ) -> None:
        n = step.sizes.get(dim, 0)
        forced = pad_to.get(dim) if pad_to else None
        what = f"{dim}={n}" + (f" padded to at least {forced}" if forced and forced > n else "")
        if q > 1:  # a full graph of q tokens per sequence pads the sequences to a bucket
            what += f" ({n // q} sequences of {q} tokens, their count padded to a bucket)"
        if self.on_overflow is Fallback.RAISE:
            raise BucketOverflowError(
                f"{self.name}: {what} is above the largest bucket {largest}. Raise the "
                "largest bucket, split the batch, or use on_overflow='eager'."
            )
        if not self._warned_overflow:  # a warning reaches users who set up no logging
            self._warned_overflow = True
            msg = (
                f"{self.name}: {what} is above the largest bucket {largest}; such steps run "
                "eagerly (on_overflow='eager'). Shown once."
            )
            warnings.warn(msg, XGraphWarning, stacklevel=5)
            logger.warning(msg)
        step.reason = "above largest bucket"

    # -- synthetic steps (pre-capture) -----------------------------------------------------

    def synthetic(
        self, n: int, kind: Kind, key_dims: Mapping[str, int], query_len: int = 1
    ) -> tuple[dict[str, torch.Tensor], AttentionInputs | None]:
        """Inputs that touch only the dummy slot and block: `n` tokens, or for a full graph
        of `query_len` > 1, n sequences of that many tokens."""
        if self.closed:
            raise self._closed_error()
        if query_len > 1:
            if kind is not Kind.FULL or not 1 < query_len <= self.full_query_len:
                raise XGraphError(
                    f"{self.name}: query_len={query_len} names full graphs of that many tokens "
                    f"per sequence; the decode runner serves 1 to {self.full_query_len} "
                    "(kind='full')."
                )
            attn = self._synthetic_query(n, query_len)
            return self._synthetic_inputs(n * query_len, key_dims), attn
        tensors = self._synthetic_inputs(n, key_dims)
        if self.attention is None:
            return tensors, None
        return tensors, self._synthetic_attention(n, decode=kind is Kind.FULL)

    def _synthetic_inputs(self, n: int, key_dims: Mapping[str, int]) -> dict[str, torch.Tensor]:
        sizes = {NUM_TOKENS: n, **key_dims}
        for name, d in self.dims.items():
            default = n if d.pad_like == NUM_TOKENS else (d.buckets[0] if d.buckets else 1)
            sizes.setdefault(name, default)
        return {
            spec.name: torch.full(
                [s if isinstance(s, int) else sizes[s] for s in spec.shape],
                spec.fill,
                dtype=spec.dtype,  # type: ignore[arg-type]
                device="cpu",  # host values, staged like a caller's
            )
            for spec in self.inputs
        }

    def _synthetic_attention(self, n: int, decode: bool) -> AttentionInputs:
        """Decode: n single-token sequences. Piecewise: as few sequences as the block-table
        width allows (host-planned runners cost per sequence), over the dummy block."""
        a = self.attention
        assert a is not None
        if decode:
            return AttentionInputs([1] * n, [1] * n, [[a.dummy_block]] * n, [a.dummy_slot] * n)
        per_seq = a.max_blocks_per_seq * a.block_size
        lens = [per_seq] * (n // per_seq) + ([n % per_seq] if n % per_seq else [])
        tables = [[a.dummy_block] * -(-q // a.block_size) for q in lens]
        return AttentionInputs(lens, lens, tables, [a.dummy_slot] * n)

    def _synthetic_query(self, n: int, q: int) -> AttentionInputs:
        """n sequences of q tokens over the dummy block (seq_len q)."""
        a = self.attention
        assert a is not None
        row = [a.dummy_block] * -(-q // a.block_size)
        return AttentionInputs([q] * n, [q] * n, [row] * n, [a.dummy_slot] * (n * q))
