"""A decode step's attention arrays checked in the fewest numpy calls.

The step's checks (`xgraph.step_attention`) take each field in turn and name the first
problem they find; a step of one query token per sequence with a block table of one width
(an array or a tensor), the step an engine issues every token, passes through them in about
twenty numpy calls. `DecodeCheck.passes` answers, in about a dozen (for up to `FEW`
sequences whose rows' used columns are few, in a loop over Python ints over those columns
only, cheaper still), whether that step passes every one of those checks:

- each seq_len is at least 1 and its last position falls in its row (1 <= seq_len <=
  width * block_size): a table indexed by seq_len, clipped at both ends to an entry naming
  a column no table has, gives each sequence's last column, and taking the per-column
  ceilings of that column from a table of exactly `width` rows raises where it is outside;
- every block id a sequence reads is a cache block other than the dummy (the dummy being
  the cache's last block, one unsigned compare against those ceilings);
- each token's slot is the one its row gives its position, and no two tokens share one.

It decides nothing of its own: where it says no, the general checks run on the same
arrays and raise the error naming the problem, so every step is refused exactly as before
and none that they would refuse gets through.
"""

from __future__ import annotations

import numpy as np

from .paging import PagedAttention
from .validation import any_true, same

SET_CHECK = 40  # slots compared through a set of Python ints up to this many, else sorted
# up to FEW sequences, Python over lists beats numpy's calls where n * (k + ROW_IDS) <=
# FEW_IDS, k the columns the longest sequence reads (a row costs about as much as ROW_IDS
# more ids; measured: one sequence up to 56 columns, two up to 24, four up to 8)
FEW, ROW_IDS, FEW_IDS = 4, 8, 64
_U32 = np.dtype(np.uint32)  # (a dtype object: `view` skips looking the type up)


def distinct(slots: np.ndarray) -> bool:
    """Whether no two entries of an int64 array are equal: a set of a few Python ints is
    cheaper than numpy's calls; more are sorted and their neighbours compared."""
    n = len(slots)
    if n < 2:
        return True
    if n <= SET_CHECK:
        return len(set(slots.tolist())) == n
    s = slots.copy()
    s.sort()
    return not any_true(s[1:] == s[:-1])


class DecodeCheck:
    """The checks of a decode step with a block table of one width (see the module doc);
    only for a layout whose dummy block is the cache's last, id > 0."""

    def __init__(self, layout: PagedAttention, ceiling: np.ndarray, max_seqs: int) -> None:
        """`ceiling[k, j]`: the largest id column j may hold in a row whose last used column
        is k (the dummy's id - 1 where j <= k, else any uint32)."""
        bs, width = layout.block_size, layout.max_blocks_per_seq
        self.bs, self.dummy = bs, layout.dummy_block
        # a 0-d array, not a numpy scalar: a ufunc takes it without converting a scalar
        # (a third of the multiply's cost), and the product is int64 as before
        self.bs64 = np.array(bs, dtype=np.int64)
        self.ceiling = ceiling
        # entry s: the last column and the offset in its block of a sequence of s tokens;
        # 0 and width * bs + 1 (where take clips every value out of range) name the column
        # `width`, which no table has
        s = np.arange(width * bs + 2, dtype=np.int64)
        self.last = (s - 1) // bs
        self.last[0] = self.last[-1] = width
        self.offset = (s - 1) % bs
        self.seq_index = np.arange(max_seqs, dtype=np.int64)
        self._widths: dict[int, tuple[np.ndarray, list[np.ndarray | None]]] = {}

    def passes(self, seq_lens: np.ndarray, table: np.ndarray, slots: np.ndarray) -> bool:
        """Whether the step passes every check (its counts and shapes checked already:
        `seq_lens` [n], `table` [n, w] int32, `slots` [n] int64)."""
        if len(seq_lens) <= FEW:
            few = self._few(seq_lens, table, slots)
            if few is not None:
                return few
        n, w = table.shape
        ceiling, starts = self._widths.get(w) or self._width(w)
        last = self.last.take(seq_lens, mode="clip")
        try:
            limits = ceiling.take(last, axis=0)  # a column past the row: IndexError
        except IndexError:
            return False
        if any_true(table.view(_U32) > limits):
            return False
        first = starts[n]
        if first is None:  # sliced once per sequence count
            first = starts[n] = self.seq_index[:n] * w
        at = first + last  # each sequence's last column, in the flat table
        # every seq_len is in [1, w * bs] here (the take above), so no clipping
        expected = table.take(at) * self.bs64 + self.offset.take(seq_lens)
        return same(slots, expected) and distinct(slots)

    def _few(self, seq_lens: np.ndarray, table: np.ndarray, slots: np.ndarray) -> bool | None:
        """`passes` for a few sequences, over Python ints: the same checks, one row at a time
        (an id is a cache block other than the dummy where 0 <= id < dummy), reading at most
        the columns the longest sequence uses; None where they cost more than numpy's calls."""
        bs, dummy = self.bs, self.dummy
        lens, tokens = seq_lens.tolist(), slots.tolist()
        n, w = table.shape
        top = w * bs  # the longest sequence a row holds
        if n * (w + ROW_IDS) > FEW_IDS:  # a wide table: the columns the longest one reads
            k = (max(lens) - 1) // bs + 1  # (a length out of range is refused below)
            if n * (k + ROW_IDS) > FEW_IDS:
                return None
            table = table[:, :k]
        for s, row, slot in zip(lens, table.tolist(), tokens):
            if not 0 < s <= top:
                return False
            last = (s - 1) // bs
            used = row[: last + 1]
            if min(used) < 0 or max(used) >= dummy or slot != row[last] * bs + (s - 1) % bs:
                return False
        return n < 2 or len(set(tokens)) == n

    def _width(self, w: int) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """Per table width, made once: the ceilings of the rows a sequence may end in (exactly
        w of them), and per sequence count where each row starts in the flattened table
        (made at its first step)."""
        starts: list[np.ndarray | None] = [None] * (len(self.seq_index) + 1)
        got = self._widths[w] = (np.ascontiguousarray(self.ceiling[:w, :w]), starts)
        return got
