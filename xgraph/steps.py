"""The step planner: a step checked, decided and staged, in that order, each move once.

    checked = planner.check(inputs, attn)       # validated; writes nothing
    decision = planner.decide(checked)          # kind, key, padded sizes, reason; writes nothing
    # several ranks: decision = lockstep.agree(checked, decision)  (xgraph.distributed)
    step = planner.stage(checked, decision)     # the one write into the persistent buffers

`plan()` makes the three moves in one call (one rank). The token inputs are checked in
`xgraph.validation`, the attention inputs normalized and checked in `xgraph.step_attention`,
the kind and key chosen here, and the step written into the persistent buffers by
`xgraph.staging` (padded by `xgraph.padding`). Nothing is written before the step is known
good, and nothing is written twice: ranks agree on the decision, not on staged buffers.
The planner never touches a graph: device-resident metadata is staged into the check's raw
buffers, and the check itself is the first piece of the key's recording, which the
executor's capture transaction records and its key cache replays (xgraph.device_check).

Deciding: decode steps (one token per sequence, or no attention) run as full graphs,
other steps piecewise, as the mode allows. Every shape-determining dim is padded to its
bucket (dims declared `pad_like` follow num_tokens), or to at least the sizes a caller
forces (`pad_to`: ranks that agreed on a key); a step above the largest bucket runs
eagerly or raises, by policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .buckets import Buckets, Dim, Input
from .buffers import BufferSpec, CopierFactory, StagedBuffers
from .callsite import warn_at_caller
from .device_check import COUNTS, CheckOps, DeviceCheck
from .errors import BucketOverflowError, InputError, XGraphError
from .interfaces import AttentionRunner
from .metadata import AttentionInputs, AttentionMetadata
from .options import Fallback, Kind, Mode
from .paging import PagedAttention
from .staging import StepStaging
from .step_attention import AttentionCheck, StepAttention
from .synthetic import SyntheticSteps
from .validation import NUM_TOKENS, TokenCheck

logger = logging.getLogger("xgraph")


@dataclass(slots=True)
class Checked:
    """A step's inputs, validated: the token tensors, the size of every symbolic dim, the
    numpy views staging writes from, and the attention arrays (None: no attention)."""

    tensors: dict[str, torch.Tensor]
    sizes: dict[str, int]
    arrays: list[np.ndarray | None]
    attn: StepAttention | None
    synthetic: bool = False  # the executor's own step (it may name the dummy block)

    @property
    def num_tokens(self) -> int:
        return self.sizes[NUM_TOKENS]


@dataclass(frozen=True, slots=True)
class Decision:
    """How a checked step runs: its kind, key and padded key dims (graph kinds), or why it
    runs eagerly. `attn` replaces the checked attention where the kind reads device-resident
    metadata on the host (a step that is not a full graph), else None."""

    kind: Kind
    key: tuple | None = None
    padded: dict[str, int] = field(default_factory=dict)
    reason: str = ""  # why it runs eagerly
    attn: StepAttention | None = None


@dataclass(slots=True)
class Staged:
    """A staged step: the decision, the real sizes, and (graph kinds) the views of the
    persistent buffers the step was written to and the metadata its runner reads."""

    kind: Kind
    key: tuple | None
    padded: dict[str, int]
    reason: str
    num_tokens: int
    tensors: dict[str, torch.Tensor]
    attn: StepAttention | None
    views: dict[str, torch.Tensor]
    metadata: AttentionMetadata | None
    device_check: CheckOps | None = None  # device metadata: the check to run before replay


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
    """Turns a step call into a staged step over the executor's persistent buffers.

    The planner never touches a graph: it checks, decides and writes buffers; recording
    and replaying (the device check's graph included) are the executor's capture
    transaction's and key cache's."""

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
        self._simple: dict[tuple[Kind | None, int, int], Decision] = {}
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
        self._synthetic = SyntheticSteps(
            name, self.inputs, self.dims, attention, self.full_query_len
        )

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
        # every view of the buffers goes: they would keep the buffers' memory past the close
        self.staging.close()
        self._staged.close()
        if self.device_check is not None:
            self.device_check.close()

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

    # -- the moves ---------------------------------------------------------------------------

    def check(
        self, inputs: Mapping[str, Any], attn: AttentionInputs | None, synthetic: bool = False
    ) -> Checked:
        """Validate a step's inputs (InputError at the first problem); writes nothing.
        `synthetic` marks the executor's own steps (pre-capture, idle ranks: dummy block
        only). Raises first what an earlier step's device-side check found."""
        if self.closed:
            raise self._closed_error()
        dc = self.device_check
        if dc is not None and dc.pending:
            dc.raise_pending()
        tensors, sizes, arrays = self.tokens.check(inputs)
        h = self._attention(attn, sizes[NUM_TOKENS], synthetic)
        return Checked(tensors, sizes, arrays, h, synthetic)

    def decide(
        self, checked: Checked, kind: Kind | None = None, pad_to: Mapping[str, int] | None = None
    ) -> Decision:
        """The step's kind, key and padding, or why it runs eagerly; writes nothing. `kind`
        forces the kind; `pad_to` pads key dims to at least these sizes (ranks agreeing on
        one key; a key dim no input uses, such as a communication dim, joins the key at its
        padded size). Above the buckets: the overflow policy (raise, or eager)."""
        d = self._classify(checked, kind, pad_to)
        h = checked.attn
        if h is not None and h.on_device and d.kind is not Kind.FULL:
            # host-planned runners and eager steps read the lengths on the host: copied
            # there (a sync) and checked like host metadata (a launch's own state: shapes only)
            assert self.attn_check is not None
            shapes_only = checked.synthetic or h.trusted
            host = self.attn_check.check(h.on_host(), checked.num_tokens, shapes_only, True)
            d = Decision(d.kind, d.key, d.padded, d.reason, host)
        return d

    def stage(self, checked: Checked, decision: Decision) -> Staged:
        """Write the decided step into the persistent buffers (graph kinds; the one write of
        the step) and send it to the device; an eager step's metadata in fresh tensors."""
        if self.closed:
            raise self._closed_error()
        h = decision.attn if decision.attn is not None else checked.attn
        kind = decision.kind
        if kind is Kind.EAGER:
            md = h.metadata(self.device) if h is not None else None
            return Staged(
                kind, None, {}, decision.reason, checked.num_tokens, checked.tensors, h, {}, md
            )
        seqs = 0
        if h is not None:  # a full graph sees the padded sequence count
            padded_tokens = decision.padded[NUM_TOKENS]
            seqs = padded_tokens // h.query_len if kind is Kind.FULL else h.num_seqs
        views, md, check = self.staging.stage(
            decision.key, decision.padded, checked.tensors, checked.arrays, h, seqs
        )
        return Staged(
            kind,
            decision.key,
            decision.padded,
            decision.reason,
            checked.num_tokens,
            checked.tensors,
            h,
            views,
            md,
            check,
        )

    def plan(
        self,
        inputs: Mapping[str, Any],
        attn: AttentionInputs | None,
        kind: Kind | None = None,
        pad_to: Mapping[str, int] | None = None,
        synthetic: bool = False,
    ) -> Staged:
        """check, decide and stage in one call: a step of one rank (see the module doc)."""
        checked = self.check(inputs, attn, synthetic)
        return self.stage(checked, self.decide(checked, kind, pad_to))

    def raise_pending(self, wait: bool = False) -> None:
        """Raise what the device-side check of an earlier step found (`wait`: for it)."""
        if self.device_check is not None:
            self.device_check.raise_pending(wait)

    def pending_error(self) -> Exception | None:
        """What the device-side check of an earlier step found and no call raised yet,
        waited for and taken (close() raises it), or None."""
        return None if self.device_check is None else self.device_check.pending_error(True)

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
        self, checked: Checked, forced: Kind | None, pad_to: Mapping[str, int] | None
    ) -> Decision:
        """Choose the kind and the key; above the buckets: the overflow policy."""
        h = checked.attn
        q = 1 if h is None else h.query_len
        n = checked.num_tokens
        if pad_to is None:  # where nothing but the kind, num_tokens and q decide: kept
            got = self._simple.get((forced, n, q))
            if got is not None:
                return got
        uniform = 1 <= q <= self.full_query_len  # a full graph can run it
        if forced is Kind.EAGER:
            return Decision(Kind.EAGER, reason="warm-up" if checked.synthetic else "forced")
        if forced is not None:
            if forced is Kind.FULL and not uniform:
                raise InputError(
                    f"{self.name}: kind='full' was forced for a step whose query lengths "
                    f"{'differ' if not q else f'are {q}'}; the decode runner's full graphs run "
                    f"steps of one query length up to {self.full_query_len}. Force 'piecewise'."
                )
            kind = forced
        elif self.mode is Mode.EAGER:
            return Decision(Kind.EAGER, reason="mode")
        elif uniform:
            kind = Kind.PIECEWISE if self.mode is Mode.PIECEWISE else Kind.FULL
        elif self.mode is Mode.FULL:
            return Decision(Kind.EAGER, reason="not decode (mode='full')")
        else:
            kind = Kind.PIECEWISE
        if kind is Kind.FULL and q > 1 and self._sequences(checked, q, pad_to) is None:
            if forced is Kind.FULL or self.mode is Mode.FULL:
                return self._overflow(checked, NUM_TOKENS, self.buckets.max, pad_to, q)
            kind = Kind.PIECEWISE  # a piecewise graph serves it, at other padded sizes
        try:
            key, padded = self._key(checked, kind, q if kind is Kind.FULL else 1, pad_to)
        except _Overflow as o:
            return self._overflow(checked, o.dim, o.largest, pad_to)
        d = Decision(kind, key, padded)
        if self.tokens_only_key and pad_to is None:
            self._simple[(forced, n, q)] = d
        return d

    def _sequences(self, step: Checked, q: int, pad_to: Mapping[str, int] | None) -> int | None:
        """The padded sequence count of a full graph of query length q > 1 (a bucket, q
        tokens each, within the largest bucket), or None where it does not fit."""
        assert step.attn is not None
        want = -(-pad_to.get(NUM_TOKENS, 0) // q) if pad_to else 0
        sb = self.buckets.pad(max(step.attn.num_seqs, want))
        return sb if sb is not None and sb * q <= self.buckets.max else None

    def _key(
        self, step: Checked, kind: Kind, q: int, pad_to: Mapping[str, int] | None
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

    def _pad(self, step: Checked, q: int, pad_to: Mapping[str, int] | None) -> dict[str, int]:
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
        self, step: Checked, dim: str, largest: int, pad_to: Mapping[str, int] | None, q: int = 1
    ) -> Decision:
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
            warn_at_caller(msg)
            logger.warning(msg)
        return Decision(Kind.EAGER, reason="above largest bucket")

    # -- synthetic steps (pre-capture) -----------------------------------------------------

    def synthetic(
        self, n: int, kind: Kind, key_dims: Mapping[str, int], query_len: int = 1
    ) -> tuple[dict[str, torch.Tensor], AttentionInputs | None]:
        """Inputs that touch only the dummy slot and block (xgraph.synthetic): `n` tokens,
        or for a full graph of `query_len` > 1, n sequences of that many tokens."""
        if self.closed:
            raise self._closed_error()
        return self._synthetic.build(n, kind, key_dims, query_len)
