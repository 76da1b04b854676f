"""The host plan of a varlen prefill step: its query tiles, one row each.

Row (sequence, first query row of the sequence, query length, tile offset): the tile holds
queries [offset, offset + block_m) of the sequence. Rows are ordered by the number of keys
the tile visits, heaviest first, so causal tiles of long sequences start in the first wave
and short ones fill in behind them. No Triton here: the plan is plain numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

COLUMNS = 4  # sequence, query start, query length, tile offset


def tile_table(query_lens: Sequence[int], seq_lens: Sequence[int], block_m: int) -> torch.Tensor:
    """int32 [tiles, COLUMNS] (host) for sequences of these query and kv lengths."""
    ql = np.asarray(query_lens, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    starts = np.cumsum(ql) - ql
    per_seq = -(-ql // block_m)
    seq = np.repeat(np.arange(len(ql)), per_seq)
    first_tile = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    offset = (np.arange(seq.shape[0]) - first_tile) * block_m
    keys = sl[seq] - ql[seq] + np.minimum(offset + block_m, ql[seq])
    order = np.argsort(-keys, kind="stable")
    table = np.stack([seq, starts[seq], ql[seq], offset], axis=1)[order]
    return torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32))


def block_m_for(max_query_len: int) -> int:
    """Query rows per tile: 16 for decode-like steps, else 64 (on an H200, 64-row tiles with
    64-key steps matched dense flash SDPA at 2048 tokens; 128-row tiles were 15% slower)."""
    return 16 if max_query_len <= 16 else 64
