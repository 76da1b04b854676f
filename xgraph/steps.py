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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .buckets import Buckets, Dim, Input
from .buffers import BufferSpec, StagedBuffers
from .errors import BucketOverflowError, InputError, XGraphError, XGraphWarning
from .metadata import AttentionInputs, AttentionMetadata
from .options import Fallback, Kind, Mode
from .paging import PagedAttention
from .validation import NUM_TOKENS, StepAttention, validate_attention, validate_inputs

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
    ) -> None:
        self.name, self.device, self.mode, self.on_overflow = name, device, mode, on_overflow
        self.buckets = buckets
        self.dims = declare_dims(name, buckets, dims)
        self.inputs = list(inputs)
        check_inputs(name, self.inputs, self.dims)
        self.attention = attention
        self.key_buckets = {n: Buckets(d.buckets) for n, d in self.dims.items() if d.buckets}
        self.max_seqs = max(attention.max_seqs, buckets.max) if attention is not None else 0
        self.staged = StagedBuffers(self._buffer_specs(), device)
        self._qsl = np.zeros(self.max_seqs + 1, dtype=np.int32)  # query start locations
        self._warned_overflow = False

    def _buffer_specs(self) -> list[BufferSpec]:
        specs = [
            BufferSpec(i.name, i.dtype,  # type: ignore[arg-type]  # Input keeps dtype loose
                       tuple(self.dims[s].max if isinstance(s, str) else int(s) for s in i.shape),
                       i.fill)
            for i in self.inputs
        ]  # fmt: skip
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
    ) -> Step:
        """Validate, classify, bucket and stage one step; `kind` forces the graph kind;
        `synthetic` marks the executor's own pre-capture steps (dummy block only)."""
        tensors, sizes = validate_inputs(self.name, self.inputs, self.dims, inputs, self.device)
        attn = self._attention(attn, sizes[NUM_TOKENS], synthetic)
        step = Step(Kind.EAGER, tensors, sizes, attn=attn)
        self._classify(step, kind)
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

    def _classify(self, step: Step, forced: Kind | None) -> None:
        """Choose the kind and the key; above the buckets: the overflow policy."""
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
            if name in step.sizes:
                p = b.pad(step.sizes[name])
                if p is None:
                    self._overflow(step, name, b.max)
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

    def _overflow(self, step: Step, dim: str, largest: int) -> None:
        n = step.sizes[dim]
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
