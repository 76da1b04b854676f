"""One step's attention inputs: as the engine gives them (host) and as runners read them (device).

`AttentionInputs` is what an engine passes per step; `AttentionMetadata` is what runners
plan on. Every conversion between them goes through this module: ragged block-table rows
become one int32 table here, and the padding rule of a graph step (padded sequences are
one token long and point at the dummy block, padded tokens write the dummy slot) is written
here once, for the executor, the reference checks and the benchmarks alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_blocks, block_size, kv_heads, dim]


def ragged_rows(
    rows: torch.Tensor | Sequence[Sequence[int]], fill: int, width: int | None = None
) -> torch.Tensor:
    """Block-table rows of any lengths -> int32 [rows, width] (default: the longest), padded
    with `fill`. A tensor is converted to int32 and padded or kept as it is."""
    if isinstance(rows, torch.Tensor):
        t = rows.to(torch.int32)
        if width is None or t.shape[-1] == width:
            return t
        out = torch.full((t.shape[0], width), fill, dtype=torch.int32, device=t.device)
        out[:, : t.shape[1]] = t[:, :width]
        return out
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    w = width if width is not None else (int(lens.max()) if len(rows) else 0)
    out = torch.full((len(rows), w), fill, dtype=torch.int32)
    if w and len(rows):
        flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int32)
        out[torch.arange(w)[None, :] < lens[:, None]] = flat
    return out


def padded_lengths(
    query_lens: Sequence[int], seq_lens: Sequence[int], num_seqs: int
) -> tuple[list[int], list[int], list[int]]:
    """(query lens, seq lens, query start locations) padded to `num_seqs` sequences of one token."""
    pad = num_seqs - len(query_lens)
    ql = [int(q) for q in query_lens] + [1] * pad
    sl = [int(s) for s in seq_lens] + [1] * pad
    return ql, sl, [0, *itertools.accumulate(ql)]


@dataclass
class AttentionInputs:
    """A step's attention inputs, on the host: one entry per sequence (slot_mapping per token)."""

    query_lens: Sequence[int]
    seq_lens: Sequence[int]
    block_tables: torch.Tensor | Sequence[Sequence[int]]
    slot_mapping: torch.Tensor | Sequence[int]

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (a full graph can run it)."""
        return all(int(q) == 1 for q in self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(int(q) for q in self.query_lens)

    def table(self, fill: int, width: int | None = None) -> torch.Tensor:
        """The block tables as one int32 [num_seqs, width] tensor padded with `fill`."""
        return ragged_rows(self.block_tables, fill, width)

    def slots(self) -> torch.Tensor:
        return torch.as_tensor(self.slot_mapping, dtype=torch.int64)

    def padded(
        self, num_seqs: int, num_tokens: int, dummy_slot: int, dummy_block: int, width: int
    ) -> AttentionInputs:
        """The inputs as a graph step of `num_seqs` sequences and `num_tokens` tokens sees them."""
        ql, sl, _ = padded_lengths(self.query_lens, self.seq_lens, num_seqs)
        table = torch.full((num_seqs, width), dummy_block, dtype=torch.int32)
        real = self.table(dummy_block, width)
        table[: real.shape[0]] = real.to("cpu")
        slots = torch.full((num_tokens,), dummy_slot, dtype=torch.int64)
        sm = self.slots().to("cpu")
        slots[: sm.shape[0]] = sm
        return AttentionInputs(ql, sl, table, slots)

    def metadata(
        self, device: torch.device | str = "cpu", fill_block: int = 0
    ) -> AttentionMetadata:
        """Metadata in fresh device tensors (eager runs and references; executors use buffers)."""
        return AttentionMetadata.build(
            self.query_lens, self.seq_lens, self.table(fill_block), self.slot_mapping, device
        )


@dataclass
class AttentionMetadata:
    """One step's attention inputs as runners read them.

    Device tensors (views of the executor's persistent buffers, padded to the bucket in a
    full graph): `slot_mapping` [tokens] int64, the cache slot each token's k/v goes to;
    `seq_lens` [seqs] int32, kv length of each sequence including this step's tokens;
    `query_start_loc` [seqs + 1] int32, cumulative query lengths; `block_tables`
    [seqs, max_blocks] int32. Host values serve runners that plan on the host: lists, or
    (`seq_lens_host` of a full-graph decode step) an int32 array that the next step
    overwrites, so read it in `plan`, not later.
    """

    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    num_tokens: int
    num_seqs: int
    query_lens_host: list[int]
    seq_lens_host: Sequence[int] | np.ndarray

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        slot_mapping: torch.Tensor | Sequence[int],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata in fresh device tensors from host values (ragged rows padded with 0)."""
        ql, sl, qsl = padded_lengths(query_lens, seq_lens, len(query_lens))
        bt = ragged_rows(block_tables, 0).to(device)
        return cls(
            slot_mapping=torch.as_tensor(slot_mapping, dtype=torch.int64).to(device),
            seq_lens=torch.tensor(sl, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            block_tables=bt,
            num_tokens=qsl[-1],
            num_seqs=len(ql),
            query_lens_host=ql,
            seq_lens_host=sl,
        )
