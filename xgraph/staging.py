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
        self._uniform: dict[tuple[int, int, int, bool, int], AttentionMetadata] = {}
        self._starts: dict[tuple[int, int], np.ndarray] = {}
        # per bank, the starts its host twin holds (a uniform step's, written by the last step
        # of that bank), None if unknown: a step of the same starts skips the write
        self._holds: list[np.ndarray | None] = [None] * staged.BANKS
        self._lists: dict[tuple[int, int], list[int]] = {}

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
        plan = self.input_views(key, padded, bank)
        later = None
        for (name, t), a in zip(plan.targets, arrays):
            if a is not None:
                write_prefix(t.np, a, t.fill)
                continue
            value = tensors[name]
            if value.is_cpu:
                write_prefix(t.host, value, t.fill)
            else:  # on the device: copied there once the host copy is queued
                later = later or []
                later.append((t.device, value, t.fill))
        nbytes, md = plan.nbytes, None
        if attn is not None:
            m = self._padded(attn, padded[NUM_TOKENS], num_seqs, bank)
            nbytes = max(nbytes, m.nbytes)
            md = self._runner_metadata(attn, m, num_seqs, bank)
            if attn.on_device and not self.trusted:
                nbytes = max(nbytes, self._counts(attn, bank))
        st.send(nbytes)
        for view, value, fill in later or ():
            write_prefix(view, value, fill)
        check = None
        if attn is not None and attn.on_device:
            # the host copy has sent the padding; the real rows follow on the device
            assert self.device_check is not None
            check = self.device_check.stage(attn, m.device, num_seqs, self.trusted)
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

    def _padded(self, h: StepAttention, num_tokens: int, num_seqs: int, bank: int) -> _Metadata:
        """The step's attention written into the bank's host twin by the padding rule."""
        a = self.attention
        assert a is not None
        m = self._buffers(num_tokens, num_seqs, bank)
        q = h.query_len
        pad_q = q or 1  # a full graph of query length q pads with sequences of q tokens
        if q:
            starts = self._starts.get((num_seqs, q))
            if starts is None:
                starts = self._starts[(num_seqs, q)] = np.arange(num_seqs + 1) * q
        else:
            starts = query_starts(h.query_lens, num_seqs, pad_q)
        write = None if self._holds[bank] is starts else starts  # None: the twin holds them
        self._holds[bank] = None  # unknown until written
        if h.on_device:  # the padding only, from the host; the real rows follow on the device
            pad_into(m.host, _NONE64, _NONE32, write, _NO_ROWS, a.dummy_slot, a.dummy_block, pad_q)
        else:
            pad_into(
                m.host, h.slots, h.seq_lens, write, h.table, a.dummy_slot, a.dummy_block, pad_q
            )
        if q:
            self._holds[bank] = starts
        return m

    def _runner_metadata(
        self, h: StepAttention, m: _Metadata, num_seqs: int, bank: int
    ) -> AttentionMetadata:
        """What runners read: device views, the token count they store (a full graph's padded
        tokens, else the real ones) and the lengths on the host (the twin's int32 seq_lens:
        read them in `plan`, the next steps overwrite them). Uniform steps: made once."""
        q = h.query_len
        num_tokens = num_seqs * q if q else len(h.slots)
        key = (len(m.host.slots), num_seqs, q, h.on_device, bank)
        md = self._uniform.get(key) if q else None
        if md is None:
            if q:
                query_lens = self._lists.get((num_seqs, q))
                if query_lens is None:
                    query_lens = self._lists[(num_seqs, q)] = [q] * num_seqs
            else:
                query_lens = h.query_lens.tolist() + [1] * (num_seqs - h.num_seqs)
            md = AttentionMetadata(
                slot_mapping=m.device["slot_mapping"],
                seq_lens=m.device["seq_lens"],
                query_start_loc=m.device["query_start_loc"],
                block_tables=m.device["block_tables"],
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                query_lens_host=query_lens,
                seq_lens_host=None if h.on_device else m.host.seq_lens,
            )
            if q:
                self._uniform[key] = md
        return md
