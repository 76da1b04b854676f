"""The step planner: one `plan()` per step validates, classifies, buckets and stages it.

    step = planner.plan(inputs, attn)   # Kind.FULL / PIECEWISE with a key and staged views,
                                        # or Kind.EAGER with the reason

Classification: decode steps (one token per sequence, or no attention) run as full graphs,
other steps piecewise, as the mode allows. Bucketing pads every shape-determining dim to
its bucket (dims declared `pad_like` follow num_tokens); a step above the largest bucket
runs eagerly or raises, by policy. Staging writes the real prefix and the declared fills
into the persistent buffers (one host-to-device copy) and returns views padded to the key.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .buckets import Buckets, Dim, Input
from .buffers import BufferSpec, CopierFactory, StagedBuffers, StagingPlan, has_numpy_twin
from .errors import BucketOverflowError, InputError, XGraphError, XGraphWarning
from .metadata import AttentionInputs, AttentionMetadata
from .options import Fallback, Kind, Mode
from .paging import PagedAttention
from .validation import (
    NUM_TOKENS,
    DecodeAttention,
    DecodeCheck,
    StepAttention,
    TokenCheck,
    validate_attention,
    validate_inputs,
)

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


class StepPlanner:
    """Turns a step call into a planned Step over the executor's persistent buffers."""

    def __init__(
        self,
        name: str,
        inputs: Sequence[Input],
        dims: Sequence[Dim],
        buckets: Buckets,
        attention: PagedAttention | None,
        device: torch.device,
        mode: Mode,
        on_overflow: Fallback,
        copier: CopierFactory | None = None,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.name, self.device, self.mode, self.on_overflow = name, device, mode, on_overflow
        self.buckets = buckets
        self.dims = declare_dims(name, buckets, dims)
        self.inputs = list(inputs)
        check_inputs(name, self.inputs, self.dims)
        self.attention = attention
        self.key_buckets = {n: Buckets(d.buckets) for n, d in self.dims.items() if d.buckets}
        self.max_seqs = max(attention.max_seqs, buckets.max) if attention is not None else 0
        self.closed = False
        self._staged = StagedBuffers(self._buffer_specs(), device, copier, allocate)
        self._qsl = np.zeros(self.max_seqs + 1, dtype=np.int32)  # query start locations
        self._warned_overflow = False
        self.decode = DecodePath(self) if DecodePath.serves(self) else None

    @property
    def staged(self) -> StagedBuffers:
        """The persistent buffers (refused once closed: their memory may be gone)."""
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
        synthetic: bool = False,
        pad_to: Mapping[str, int] | None = None,
    ) -> Step:
        """Validate, classify, bucket and stage one step; `kind` forces the graph kind;
        `synthetic` marks the executor's own pre-capture steps (dummy block only); `pad_to`
        pads key dims to at least these sizes (ranks agreeing on one key; a key dim no input
        uses, such as a communication dim, joins the key at its padded size)."""
        if self.closed:
            raise self._closed_error()
        if self.decode is not None and kind is None and not pad_to:
            step = self.decode.plan(inputs, attn)
            if step is not None:
                return step
        tensors, sizes = validate_inputs(self.name, self.inputs, self.dims, inputs, self.device)
        attn = self._attention(attn, sizes[NUM_TOKENS], synthetic)
        step = Step(Kind.EAGER, tensors, sizes, attn=attn)
        self._classify(step, kind, pad_to or {})
        if step.kind is Kind.EAGER:
            if step.attn is not None:
                step.metadata = step.attn.inputs().metadata(self.device)
            return step
        self._stage(step)
        return step

    def _attention(
        self, attn: AttentionInputs | None, num_tokens: int, synthetic: bool
    ) -> StepAttention | None:
        if self.attention is None:
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
        return validate_attention(
            self.name, self.attention, attn, num_tokens, self.max_seqs, self.device, synthetic
        )

    def _classify(self, step: Step, forced: Kind | None, pad_to: Mapping[str, int]) -> None:
        """Choose the kind and the key; above the buckets: the overflow policy."""
        if forced is Kind.EAGER:
            step.reason = "warm-up"
            return
        if forced is not None:
            kind = forced
        elif self.mode is Mode.EAGER:
            step.reason = "mode"
            return
        elif step.attn is None or step.attn.is_decode:
            kind = Kind.PIECEWISE if self.mode is Mode.PIECEWISE else Kind.FULL
        elif self.mode is Mode.FULL:
            step.reason = "not decode (mode='full')"
            return
        else:
            kind = Kind.PIECEWISE
        padded: dict[str, int] = {}
        for name, b in self.key_buckets.items():
            if name in step.sizes or name in pad_to:
                want = max(step.sizes.get(name, 0), pad_to.get(name, 0))
                p = b.pad(want)
                if p is None:
                    self._overflow(step, name, want, b.max)
                    return
                padded[name] = p
        for name, d in self.dims.items():
            if d.pad_like is not None and name in step.sizes:
                padded[name] = padded[d.pad_like]
                if step.sizes[name] > padded[name]:
                    raise InputError(
                        f"{self.name}: dim {name!r} ({step.sizes[name]}) exceeds the "
                        f"{d.pad_like} bucket {padded[name]} it is padded like."
                    )
        step.kind, step.padded = kind, padded
        # piecewise pieces never see sequence-shaped data, so the batch composition is not
        # part of their key; a full graph bakes it in through the padded sequence count
        step.key = (kind.value, *(padded[n] for n in self.key_buckets if n in padded))

    def _overflow(self, step: Step, dim: str, n: int, largest: int) -> None:
        if self.on_overflow is Fallback.RAISE:
            raise BucketOverflowError(
                f"{self.name}: {dim}={n} is above the largest bucket {largest}. Raise the "
                "largest bucket, split the batch, or use on_overflow='eager'."
            )
        if not self._warned_overflow:  # a warning reaches users who set up no logging
            self._warned_overflow = True
            msg = (
                f"{self.name}: {dim}={n} is above the largest bucket {largest}; such steps run "
                "eagerly (on_overflow='eager'). Shown once."
            )
            warnings.warn(msg, XGraphWarning, stacklevel=5)
            logger.warning(msg)
        step.reason = "above largest bucket"

    # -- stage -----------------------------------------------------------------------------

    def _stage(self, step: Step) -> None:
        """Write the step into the persistent buffers; views padded to the key."""
        st = self.staged
        st.begin()
        for spec in self.inputs:
            extent = [
                int(s) if isinstance(s, int) else step.padded.get(s, self.dims[s].max)
                for s in spec.shape
            ]
            step.views[spec.name] = st.write(spec.name, step.tensors[spec.name], extent)
        if step.attn is not None:
            step.metadata = self._stage_attention(step)
        st.flush()

    def _stage_attention(self, step: Step) -> AttentionMetadata:
        a, h, st = self.attention, step.attn, self.staged
        assert a is not None and h is not None
        tb = step.padded[NUM_TOKENS]
        full = step.kind is Kind.FULL
        n = len(h.query_lens)
        b = tb if full else n  # a full graph sees the padded sequence count
        seq_lens = st.write("seq_lens", h.seq_lens, (b,))  # padded sequences: seq_len 1
        qsl = self._qsl
        qsl[1 : n + 1] = np.cumsum(h.query_lens)
        qsl[n + 1 : b + 1] = qsl[n] + np.arange(1, b - n + 1)  # padded: one token each
        sl = h.seq_lens.tolist() + [1] * (b - n)
        return AttentionMetadata(
            slot_mapping=st.write("slot_mapping", h.slots, (tb,)),
            seq_lens=seq_lens,
            query_start_loc=st.write("query_start_loc", qsl[: b + 1], (b + 1,)),
            block_tables=st.write("block_tables", h.table, (b, a.max_blocks_per_seq)),
            num_tokens=tb if full else step.num_tokens,
            num_seqs=b,
            query_lens_host=h.query_lens.tolist() + [1] * (b - n),
            seq_lens_host=sl,
        )

    # -- synthetic steps (pre-capture) -----------------------------------------------------

    def synthetic(
        self, n: int, kind: Kind, key_dims: Mapping[str, int]
    ) -> tuple[dict[str, torch.Tensor], AttentionInputs | None]:
        """Inputs of `n` tokens that touch only the dummy slot and block."""
        if self.closed:
            raise self._closed_error()
        sizes = {NUM_TOKENS: n, **key_dims}
        for name, d in self.dims.items():
            default = n if d.pad_like == NUM_TOKENS else (d.buckets[0] if d.buckets else 1)
            sizes.setdefault(name, default)
        tensors = {
            spec.name: torch.full(
                [s if isinstance(s, int) else sizes[s] for s in spec.shape],
                spec.fill,
                dtype=spec.dtype,  # type: ignore[arg-type]
            )
            for spec in self.inputs
        }
        if self.attention is None:
            return tensors, None
        return tensors, self._synthetic_attention(n, decode=kind is Kind.FULL)

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


# -- the decode fast path ------------------------------------------------------------------


# (num_tokens, numpy views of the token inputs, the tensors by name, attention arrays)
Checked = tuple[int, list[np.ndarray], dict[str, torch.Tensor], DecodeAttention | None]


@dataclass(frozen=True)
class _Bucket:
    """One decode bucket's staging, worked out at its first step."""

    size: int
    key: tuple
    padded: dict[str, int]
    plan: StagingPlan
    inputs: list[tuple[np.ndarray, float | int]]  # (host view, fill) per input, in order
    views: dict[str, torch.Tensor]  # device views of the inputs
    qsl: np.ndarray  # a decode step's query start locations: 0, 1, ..., size
    query_lens: list[int]  # [1] * size, the host query lengths (never mutated)


class DecodePath:
    """Decode steps as full graphs with host inputs: lengths checked, the step written into
    the host twin through views made once per bucket, block ids and slots checked on what
    was written (vectorized, no loop over sequences), then sent in one copy.

    `plan` answers None for anything else, and for anything wrong: the general path then
    plans the step, or refuses it with the full validation's message (a refused step has
    written the host twin only, never the buffers graphs read). It accepts only what the
    general path accepts and stages the same bytes (tests/test_decode_path.py).
    """

    @staticmethod
    def serves(p: StepPlanner) -> bool:
        """Full-graph decode, and inputs that are [num_tokens, fixed...] of numpy dtypes."""
        return (
            p.mode in (Mode.AUTO, Mode.FULL)
            and list(p.dims) == [NUM_TOKENS]
            and all(i.shape[:1] == (NUM_TOKENS,) and has_numpy_twin(i.dtype) for i in p.inputs)
            and all(isinstance(d, int) for i in p.inputs for d in i.shape[1:])
        )

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner
        self.staged = planner.staged
        self.tokens = TokenCheck(planner.inputs)
        a = planner.attention
        self.attention = (
            DecodeCheck(a, planner.max_seqs, planner.staged.np_views["block_tables"])
            if a is not None
            else None
        )
        self.buckets: dict[int, _Bucket | None] = {}
        self.pad = planner.buckets.pad

    def plan(self, inputs: Mapping[str, Any], attn: AttentionInputs | None) -> Step | None:
        checked = self.validate(inputs, attn)
        if checked is None:
            return None
        bucket = self.bucket(checked[0])
        return None if bucket is None else self.stage(checked, bucket)

    def validate(self, inputs: Mapping[str, Any], attn: AttentionInputs | None) -> Checked | None:
        """The checks that need nothing staged: inputs, lengths, rows long enough."""
        tokens = self.tokens.check(inputs)
        if tokens is None:
            return None
        n, arrays = tokens
        tensors = inputs if type(inputs) is dict else dict(inputs)  # checked: names, tensors
        if self.attention is None:
            return (n, arrays, tensors, None) if attn is None else None
        if type(attn) is not AttentionInputs:
            return None
        d = self.attention.check(attn, n)
        return None if d is None else (n, arrays, tensors, d)

    def bucket(self, n: int) -> _Bucket | None:
        """The staging of n tokens' bucket; None above the largest (the overflow policy)."""
        tb = self.pad(n)
        if tb is None:
            return None
        b = self.buckets.get(tb, False)
        if b is False:
            b = self.buckets[tb] = self._new_bucket(tb)
        return b  # type: ignore[return-value]

    def _new_bucket(self, tb: int) -> _Bucket | None:
        p = self.planner
        extents = {i.name: (tb, *(int(s) for s in i.shape[1:])) for i in p.inputs}
        if p.attention is not None:
            w = p.attention.max_blocks_per_seq
            extents.update(
                slot_mapping=(tb,),
                seq_lens=(tb,),
                query_start_loc=(tb + 1,),
                block_tables=(tb, w),
            )
        plan = p.staged.plan(extents)
        if plan is None:
            return None
        return _Bucket(
            size=tb,
            key=(Kind.FULL.value, tb),
            padded={NUM_TOKENS: tb},
            plan=plan,
            inputs=[(plan.host[i.name], plan.fills[i.name]) for i in p.inputs],
            views={i.name: plan.device[i.name] for i in p.inputs},
            qsl=np.arange(tb + 1, dtype=np.int32),
            query_lens=[1] * tb,
        )

    def stage(self, checked: Checked, b: _Bucket) -> Step | None:
        """Write the step into the host twin, check its layout there, send it in one copy."""
        n, arrays, tensors, d = checked
        tb = b.size
        self.staged.begin()  # the previous step's copy has read the twin
        for (view, fill), a in zip(b.inputs, arrays):
            view[:n] = a
            if n < tb:
                view[n:] = fill
        h = md = None
        if d is not None:
            h = self._stage_attention(d, n, b)
            if h is None:
                self.staged.discard(b.plan.nbytes)
                return None
            dev = b.plan.device
            md = AttentionMetadata(  # positional: num_tokens, num_seqs, host lengths
                dev["slot_mapping"],
                dev["seq_lens"],
                dev["query_start_loc"],
                dev["block_tables"],
                tb,
                tb,
                b.query_lens,
                b.plan.host["seq_lens"],  # the twin, padded: no list built per step
            )
        self.staged.send(b.plan.nbytes)
        return Step(Kind.FULL, tensors, {NUM_TOKENS: n}, h, b.key, b.padded, b.views, md)

    def _stage_attention(self, d: DecodeAttention, n: int, b: _Bucket) -> StepAttention | None:
        check, host, tb = self.attention, b.plan.host, b.size
        assert check is not None
        slots, sl = host["slot_mapping"], host["seq_lens"]
        slots[:n] = d.slots
        sl[:n] = d.seq_lens
        if n < tb:  # padded sequences: one token at the dummy slot, seq_len 1, dummy blocks
            slots[n:] = b.plan.fills["slot_mapping"]
            sl[n:] = 1
        host["query_start_loc"][:] = b.qsl
        table = check.stage(d, n, tb)
        if not check.check_staged(d, table):
            return None
        return StepAttention(check.ones[:n], d.seq_lens, table, d.slots, True)
