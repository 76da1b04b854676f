"""One step's attention inputs: as the engine gives them and as runners read them.

`AttentionInputs` is what an engine passes per step; `AttentionMetadata` is what runners
plan on. Between the two the executor normalizes and checks the inputs
(`xgraph.step_attention`) and pads them by the rule of `xgraph.padding`, which
`AttentionInputs.padded` applies too, for references.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .padding import pad_into, padded_arrays, query_starts

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
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64, device="cpu")
    w = width if width is not None else (int(lens.max()) if len(rows) else 0)
    out = torch.full((len(rows), w), fill, dtype=torch.int32, device="cpu")
    if w and len(rows):
        flat = torch.tensor(
            list(itertools.chain.from_iterable(rows)), dtype=torch.int32, device="cpu"
        )
        out[torch.arange(w, device="cpu")[None, :] < lens[:, None]] = flat
    return out


@dataclass
class AttentionInputs:
    """A step's attention inputs: one entry per sequence (slot_mapping: one per token).

    Lists, numpy arrays or tensors (lengths of any integer dtype, block tables int32,
    slots int64 or int32: an int32 tensor, what flash-attn-style engines build, is widened
    while staging, exactly), on the host or on the executor's device; block tables may be
    ragged lists of rows. An executor also takes a mapping with exactly these four fields.

    A block-table row must hold a real block of the cache (0 to num_blocks - 1, not the
    dummy) in every column a sequence reads: columns 0 to (seq_len - 1) // block_size.
    Past its last used column a row may hold anything that fits int32 (-1 padding, stale
    ids, ids past the cache): nothing checks it, and xgraph's runners never let it reach a
    result (they read the used columns only, or clamp and mask). A -1 (or any id outside
    the cache, or the dummy) in a used column is refused: InputError on the host; device
    metadata has the sequence redirected to the dummy block and the error raised by the
    next step. Tables wider than `max_blocks_per_seq` are refused, padding or not.
    """

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
        self,
        num_seqs: int,
        num_tokens: int,
        dummy_slot: int,
        dummy_block: int,
        width: int,
        pad_query_len: int = 1,
    ) -> AttentionInputs:
        """The inputs as a graph step of `num_seqs` sequences and `num_tokens` tokens sees them
        (host tensors), padded by the rule of `xgraph.padding` (padded sequences one token
        long; `pad_query_len` tokens in a full graph of several tokens per sequence)."""
        ql = np.asarray(self.query_lens, dtype=np.int64).reshape(-1)
        out = padded_arrays(num_tokens, num_seqs, width)
        pad_into(
            out,
            self.slots().cpu().numpy().reshape(-1),
            np.asarray(torch.as_tensor(self.seq_lens).cpu(), dtype=np.int64).reshape(-1),
            query_starts(ql, num_seqs, pad_query_len),
            self.table(dummy_block, width).cpu().numpy(),
            dummy_slot,
            dummy_block,
            pad_query_len,
        )
        lens = ql.tolist() + [pad_query_len] * (num_seqs - len(ql))
        return AttentionInputs(
            lens, out.seq_lens.tolist(), torch.from_numpy(out.table), torch.from_numpy(out.slots)
        )

    def metadata(
        self, device: torch.device | str = "cpu", fill_block: int = 0
    ) -> AttentionMetadata:
        """Metadata in fresh device tensors (eager runs and references; executors use buffers)."""
        return AttentionMetadata.build(
            self.query_lens, self.seq_lens, self.table(fill_block), self.slot_mapping, device
        )


@dataclass
class LaunchState(AttentionInputs):
    """Device metadata a multi-step launch left behind (xgraph.decode_loop), the next launch's
    start: derived on the device from metadata the executor had checked and blocks the host
    had checked, by the launch's own feedback, so a full graph stages it as given (no device
    check: a finished sequence's slot is the dummy slot, which the check would refuse).
    Only the loop builds it; an engine that wants the same for its own tables uses
    PagedAttention(validate="trusted")."""


@dataclass
class AttentionMetadata:
    """One step's attention inputs as runners read them.

    Device tensors (views of the executor's persistent buffers, padded to the key in a
    full graph): `slot_mapping` [tokens] int64, the cache slot each token's k/v goes to;
    `seq_lens` [seqs] int32, kv length of each sequence including this step's tokens;
    `query_start_loc` [seqs + 1] int32, cumulative query lengths; `block_tables`
    [seqs, max_blocks] int32. Host values serve runners that plan on the host:
    `num_tokens` (the tokens to store: a full graph's padded count, else the real one),
    `num_seqs`, `query_lens_host` (a list) and `seq_lens_host` (in an executor's step, an
    int32 array over its staged lengths that later steps overwrite: read it in `plan`,
    keep no reference; a list in metadata built by `build`).
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
        ql, sl = [int(q) for q in query_lens], [int(s) for s in seq_lens]
        qsl = [0, *itertools.accumulate(ql)]
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
