"""Staging: a checked step written into the persistent buffers, one routine for every step.

The token inputs go to the prefix of their buffers at the key's padded extent (`fill`
after them); the attention arrays go to the metadata buffers by the padding rule of
`xgraph.padding`; then one copy sends the written prefix of the packed host twin to the
device, and inputs that were already on the device are copied there after it. The views a
step writes through, and the metadata a full graph's runner reads, are worked out at the
first step of each key or batch size and looked up afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .buckets import Input
from .buffers import StagedBuffers, Target, has_numpy_twin, write_prefix
from .device_check import COUNTS, CheckOps, DeviceCheck
from .metadata import AttentionMetadata
from .padding import PaddedArrays, pad_into, query_starts
from .paging import PagedAttention
from .step_attention import StepAttention
from .validation import NUM_TOKENS

METADATA = ("slot_mapping", "seq_lens", "query_start_loc", "block_tables")
_NONE64, _NONE32 = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
_NO_ROWS = np.zeros((0, 0), dtype=np.int32)


@dataclass(frozen=True)
class _Inputs:
    """One key's token-input staging: a target per declared input, and the device views."""

    targets: list[tuple[str, Target]]
    views: dict[str, torch.Tensor]
    nbytes: int


@dataclass(frozen=True)
class _Metadata:
    """The metadata buffers of one (padded tokens, sequences): host views to pad into, the
    device views runners read, and the copy size."""

    host: PaddedArrays
    device: dict[str, torch.Tensor]
    nbytes: int


@dataclass(frozen=True)
class _Uniform:
    """A uniform step's (q tokens per sequence) staging of one (padded tokens, sequences, q,
    device metadata, bank), made once: its buffers, query starts and runner metadata."""

    buffers: _Metadata
    starts: np.ndarray
    metadata: AttentionMetadata


class StepStaging:
    """Writes planned steps into one executor's persistent buffers (see the module doc)."""

    def __init__(
        self,
        staged: StagedBuffers,
        inputs: Sequence[Input],
        attention: PagedAttention | None,
        maxima: dict[str, int],
        device_check: DeviceCheck | None = None,
    ) -> None:
        self.staged, self.inputs, self.attention = staged, list(inputs), attention
        self.device_check = device_check
        self.trusted = attention is not None and attention.validate == "trusted"
        self.maxima = maxima  # the size of each symbolic dim outside the key: its max
        self.numpy_ok = [has_numpy_twin(i.dtype) for i in self.inputs]
        self._inputs: dict[tuple[int, tuple], _Inputs] = {}  # (bank, key) ->
        self._metadata: dict[tuple[int, int, int], _Metadata] = {}  # (tokens, seqs, bank) ->
        self._uniform: dict[tuple[int, int, int, bool, int], _Uniform] = {}
        self._starts: dict[tuple[int, int], np.ndarray] = {}  # (seqs, q) -> a uniform step's
        # per bank, the starts its host twin holds (a uniform step's, written by the last step
        # of that bank), None if unknown: a step of the same starts skips the write
        self._holds: list[np.ndarray | None] = [None] * staged.BANKS
        if attention is not None:
            self.dummy_slot, self.dummy_block = attention.dummy_slot, attention.dummy_block

    def close(self) -> None:
        """Drop every view of the persistent buffers held for later steps (their memory is
        given back with the last view)."""
        self._inputs.clear()
        self._metadata.clear()
        self._uniform.clear()

    def input_views(self, key: tuple, padded: dict[str, int], bank: int) -> _Inputs:
        """The staging of the token inputs for a key (extents: ints as declared, key dims
        padded, other dims at their max) in a bank, worked out at its first step."""
        got = self._inputs.get((bank, key))
        if got is None:
            targets = [
                (i.name, self.staged.target(i.name, self._extent(i.shape, padded), bank))
                for i in self.inputs
            ]
            got = self._inputs[(bank, key)] = _Inputs(
                targets,
                {name: t.device for name, t in targets},
                max((t.end for _, t in targets), default=0),
            )
        return got

    def _extent(self, shape: Sequence[Any], padded: dict[str, int]) -> tuple[int, ...]:
        return tuple(s if isinstance(s, int) else padded.get(s, self.maxima[s]) for s in shape)

    def stage(
        self,
        key: tuple,
        padded: dict[str, int],
        tensors: dict[str, torch.Tensor],
        arrays: Sequence[np.ndarray | None],
        attn: StepAttention | None,
        num_seqs: int,
    ) -> tuple[dict[str, torch.Tensor], AttentionMetadata | None, CheckOps | None]:
        """Write a step (token inputs at the key's extents; attention padded to the key's
        tokens and `num_seqs` sequences: a full graph's, or the step's own) and send it:
        (input views, metadata, the device check to run before the step's graph)."""
        st = self.staged
        bank = st.begin()  # this bank's last copy has read it
        plan = self._inputs.get((bank, key)) or self.input_views(key, padded, bank)
        later = None
        for (name, t), a in zip(plan.targets, arrays):
            if a is not None:
                if a.shape == t.np.shape:  # the key's extent exactly (no fill)
                    t.np[...] = a
                else:
                    write_prefix(t.np, a, t.fill)
                continue
            value = tensors[name]
            if value.is_cpu:
                write_prefix(t.host, value, t.fill)
            else:  # on the device: copied there once the host copy is queued
                later = later or []
                later.append((t.device, value, t.fill))
        nbytes, md = plan.nbytes, None
        trusted = self.trusted or (attn is not None and attn.trusted)
        if attn is not None:
            m, md = self._padded(attn, padded[NUM_TOKENS], num_seqs, bank)
            nbytes = max(nbytes, m.nbytes)
            if attn.on_device and not trusted:
                nbytes = max(nbytes, self._counts(attn, bank))
        st.send(nbytes)
        for view, value, fill in later or ():
            write_prefix(view, value, fill)
        check = None
        if attn is not None and attn.on_device:
            # the host copy has sent the padding; the real rows follow on the device
            assert self.device_check is not None
            check = self.device_check.stage(attn, m.device, num_seqs, trusted)
        return plan.views, md, check

    def _counts(self, h: StepAttention, bank: int) -> int:
        """Stage a checked device step's real counts (sequences, table width) for the
        device check; the end of what the copy must send."""
        t = self.staged.target(COUNTS, (2,), bank)
        assert t.np is not None
        t.np[0], t.np[1] = h.table.shape
        return t.end

    def _buffers(self, num_tokens: int, num_seqs: int, bank: int) -> _Metadata:
        key = (num_tokens, num_seqs, bank)
        m = self._metadata.get(key)
        if m is None:
            a = self.attention
            assert a is not None
            extents = {
                "slot_mapping": (num_tokens,),
                "seq_lens": (num_seqs,),
                "query_start_loc": (num_seqs + 1,),
                "block_tables": (num_seqs, a.max_blocks_per_seq),
            }
            t = {name: self.staged.target(name, e, bank) for name, e in extents.items()}
            host = PaddedArrays(*(t[name].np for name in METADATA))  # type: ignore[arg-type]
            m = self._metadata[key] = _Metadata(
                host, {name: t[name].device for name in METADATA}, max(x.end for x in t.values())
            )
        return m

    def _padded(
        self, h: StepAttention, num_tokens: int, num_seqs: int, bank: int
    ) -> tuple[_Metadata, AttentionMetadata]:
        """The step's attention written into the bank's host twin by the padding rule: its
        buffers and the metadata its runner reads."""
        q = h.query_len
        if q:
            u = self._uniform.get((num_tokens, num_seqs, q, h.on_device, bank))
            if u is None:
                u = self._uniform_staging(h, num_tokens, num_seqs, bank)
            m, starts, md = u.buffers, u.starts, u.metadata
        else:
            m = self._buffers(num_tokens, num_seqs, bank)
            starts = query_starts(h.query_lens, num_seqs, 1)
            md = self._runner_metadata(h, m, num_seqs)
        write = None if self._holds[bank] is starts else starts  # None: the twin holds them
        self._holds[bank] = None  # unknown until written
        pad_q = q or 1  # a full graph of query length q pads with sequences of q tokens
        if h.on_device:  # the padding only, from the host; the real rows follow on the device
            pad_into(
                m.host, _NONE64, _NONE32, write, _NO_ROWS, self.dummy_slot, self.dummy_block, pad_q
            )
        else:
            pad_into(
                m.host,
                h.slots,
                h.seq_lens,
                write,
                h.table,
                self.dummy_slot,
                self.dummy_block,
                pad_q,
            )
        if q:
            self._holds[bank] = starts
        return m, md

    def _uniform_staging(
        self, h: StepAttention, num_tokens: int, num_seqs: int, bank: int
    ) -> _Uniform:
        """A uniform step's buffers, starts and runner metadata, at its first step."""
        q = h.query_len
        starts = self._starts.get((num_seqs, q))
        if starts is None:  # one array per (seqs, q): the banks' twins are told apart by it
            starts = self._starts[(num_seqs, q)] = np.arange(num_seqs + 1) * q
        m = self._buffers(num_tokens, num_seqs, bank)
        u = _Uniform(m, starts, self._runner_metadata(h, m, num_seqs))
        self._uniform[(num_tokens, num_seqs, q, h.on_device, bank)] = u
        return u

    def _runner_metadata(self, h: StepAttention, m: _Metadata, num_seqs: int) -> AttentionMetadata:
        """What runners read: device views, the token count they store (a full graph's padded
        tokens, else the real ones) and the lengths on the host (the twin's int32 seq_lens:
        read them in `plan`, the next steps overwrite them)."""
        q = h.query_len
        if q:
            query_lens = [q] * num_seqs
        else:
            query_lens = h.query_lens.tolist() + [1] * (num_seqs - h.num_seqs)
        return AttentionMetadata(
            slot_mapping=m.device["slot_mapping"],
            seq_lens=m.device["seq_lens"],
            query_start_loc=m.device["query_start_loc"],
            block_tables=m.device["block_tables"],
            num_tokens=num_seqs * q if q else len(h.slots),
            num_seqs=num_seqs,
            query_lens_host=query_lens,
            seq_lens_host=None if h.on_device else m.host.seq_lens,
        )
