"""The padding rule of a graph step, written once.

A graph runs at its key's padded sizes, so a step is padded before a graph reads it:

- padded tokens write their k/v to the dummy slot;
- a full graph also pads the sequences to the key's sequence count: each padded sequence
  is `pad_query_len` tokens long (1 in decode), has that seq_len, and its block-table row
  is the dummy block throughout;
- block-table columns past a sequence's real row are the dummy block.

`pad_into` writes a step's arrays into output arrays of the padded sizes (the executor's
host twin, or fresh arrays for references), in a few slice assignments. Numpy only: the
executor, the references and the benchmarks all pad through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PaddedArrays:
    """Output arrays of one padded step: `slots` [tokens], `seq_lens` [seqs], `query_start_loc`
    [seqs + 1], `table` [seqs, width]; their lengths are the padded sizes."""

    slots: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    table: np.ndarray


def query_starts(query_lens: np.ndarray, num_seqs: int, pad_query_len: int) -> np.ndarray:
    """Cumulative query lengths [num_seqs + 1] of the real sequences then the padded ones."""
    n = len(query_lens)
    out = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=out[1 : n + 1])
    out[n + 1 :] = out[n] + pad_query_len * np.arange(1, num_seqs - n + 1)
    return out


def pad_into(
    out: PaddedArrays,
    slots: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray | None,
    table: np.ndarray,
    dummy_slot: int,
    dummy_block: int,
    pad_query_len: int = 1,
) -> None:
    """Write the real step (its arrays: slots [tokens], seq_lens [n], query_start_loc
    [num seqs of `out` + 1], already padded, or None where `out` holds them already, table
    [n, w]) into `out`, padding by the rule."""
    t, n, w = len(slots), len(seq_lens), table.shape[1]
    rows = out.table
    out.slots[:t] = slots
    out.seq_lens[:n] = seq_lens
    if query_start_loc is not None:
        out.query_start_loc[...] = query_start_loc
    if w < rows.shape[1]:
        rows[:n, :w] = table
        rows[:n, w:] = dummy_block
    else:  # the full width: one index less to build
        rows[:n] = table
    if t < len(out.slots):  # (the tests skip empty writes: each costs a numpy call)
        out.slots[t:] = dummy_slot
    if n < len(out.seq_lens):
        out.seq_lens[n:] = pad_query_len
        rows[n:] = dummy_block


def padded_arrays(num_tokens: int, num_seqs: int, width: int) -> PaddedArrays:
    """Fresh output arrays (int64 slots, int32 lengths and table), for references."""
    return PaddedArrays(
        np.empty(num_tokens, dtype=np.int64),
        np.empty(num_seqs, dtype=np.int32),
        np.empty(num_seqs + 1, dtype=np.int32),
        np.empty((num_seqs, width), dtype=np.int32),
    )
