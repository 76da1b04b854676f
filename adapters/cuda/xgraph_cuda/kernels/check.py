"""The device check of a key's device metadata in one launch (`xgraph.device_check`).

The core's check is some thirty torch ops, each a kernel of its own in the check's graph;
this is one program that does the same: it walks the key's sequences in tiles (each row's
length against its query length and its row, each block id a row reads against the cache
and the dummy), writes the padded lengths and block table, then walks the tokens (each
slot against the one its row gives its position, and against every earlier real token's
slot), writes the padded slots, and keeps the first problem where none is kept yet. Every
value is read from the raw buffers as given; nothing is read outside them, whatever the
values.

A token's duplicate check compares it with every earlier token, tile by tile: quadratic,
so a key of more than MAX_TOKENS tokens is declined (the torch ops check it), as is one
whose buffers are not laid out as the core lays them (rows of the table's full width).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgraph.adapter import CheckCall

MAX_TOKENS = 8192
NONE = tl.constexpr(2**62)  # no problem's index
BLOCK_S, BLOCK_T, MAX_BLOCK_W = 64, 64, 64
_TYPES = (
    ("seq_lens", torch.int64),
    ("table", torch.int32),
    ("slots", torch.int64),
    ("counts", torch.int64),
    ("error", torch.int64),
    ("out_seq_lens", torch.int32),
    ("out_table", torch.int32),
    ("out_slots", torch.int64),
)


@triton.jit
def _rows(SeqLens, Table, rows, live, w, q, W, bs, num_blocks, dummy, BLOCK_W: tl.constexpr):
    """Per row (where `live`): its seq_len, whether that is outside [q, its row], and the
    first column it reads (<= its last) holding a block id outside the cache or the dummy
    block (W where none)."""
    sl = tl.load(SeqLens + rows, mask=live, other=1)
    last = tl.where(sl >= 1, (sl - 1) // bs, -1)
    bad_len = (sl < q) | (last >= w)
    first = sl * 0 + W
    for c0 in range(0, W, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = live[:, None] & (cols[None, :] < W) & (cols[None, :] <= last[:, None])
        ids = tl.load(Table + rows[:, None] * W + cols[None, :], mask=m, other=0).to(tl.int64)
        bad = m & ((ids < 0) | (ids >= num_blocks) | (ids == dummy))
        first = tl.minimum(first, tl.min(tl.where(bad, cols[None, :], W), axis=1))
    return sl, bad_len, first


@triton.jit
def _keep_first(idx, code, value, best, best_code, best_value):
    """The running first problem: (index, code, value) of the smallest index where code != 0."""
    found = tl.min(tl.where(code != 0, idx, NONE))
    take = found < best
    best_code = tl.where(take, tl.sum(tl.where(idx == found, code, 0)), best_code)
    best_value = tl.where(take, tl.sum(tl.where(idx == found, value, 0)), best_value)
    return tl.minimum(found, best), best_code, best_value


@triton.jit
def _sequences(
    SeqLens,
    Table,
    Counts,
    OutSeqLens,
    OutTable,
    S,
    q,
    W,
    bs,
    num_blocks,
    dummy_block,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Each sequence's length and row checked; the padded lengths and block table written;
    the first problem among them returned (index NONE: none)."""
    n, w = tl.load(Counts), tl.load(Counts + 1)
    best = tl.program_id(0).to(tl.int64) * 0 + NONE  # int64 scalars carried through the loop
    best_code, best_value = best * 0, best * 0
    for r0 in range(0, S, BLOCK_S):
        rows = r0 + tl.arange(0, BLOCK_S)
        live = rows < S
        real = live & (rows < n)
        sl, bad_len, first = _rows(
            SeqLens, Table, rows, live, w, q, W, bs, num_blocks, dummy_block, BLOCK_W
        )
        bad_block = first < W
        first_id = tl.load(Table + rows * W + tl.minimum(first, W - 1), mask=live, other=0)
        code = tl.where(real, tl.where(bad_len, 1, tl.where(bad_block, 2, 0)), 0).to(tl.int64)
        keep = real & ~(bad_len | bad_block)
        value = tl.where(bad_len, sl, first_id.to(tl.int64))
        best, best_code, best_value = _keep_first(
            rows.to(tl.int64), code, value, best, best_code, best_value
        )
        tl.store(OutSeqLens + rows, tl.where(keep, sl, q).to(tl.int32), mask=live)
        for c0 in range(0, W, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            m = live[:, None] & (cols[None, :] < W)
            at = rows[:, None] * W + cols[None, :]
            ids = tl.load(Table + at, mask=m, other=0)
            use = keep[:, None] & (cols[None, :] < w)
            tl.store(OutTable + at, tl.where(use, ids, dummy_block).to(tl.int32), mask=m)
    return best, best_code, best_value


@triton.jit
def _twice(Slots, t, slot, n, q, T, t0, BLOCK_T: tl.constexpr):
    """Whether an earlier real token of the step has the slot of each token of `t`."""
    twice = t < 0
    for u0 in range(0, t0 + BLOCK_T, BLOCK_T):
        u = u0 + tl.arange(0, BLOCK_T)
        earlier = (u < T) & (u // q < n)
        other = tl.load(Slots + u, mask=earlier, other=0)
        same = earlier[None, :] & (u[None, :] < t[:, None]) & (other[None, :] == slot[:, None])
        twice = twice | (tl.max(same.to(tl.int32), axis=1) > 0)
    return twice


@triton.jit
def _tokens(
    SeqLens,
    Table,
    Slots,
    Counts,
    OutSlots,
    S,
    q,
    W,
    bs,
    num_blocks,
    dummy_block,
    dummy_slot,
    best,
    best_code,
    best_value,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Each token's slot checked; the padded slots written; the first problem so far
    returned (the sequences' problems come first)."""
    n, w = tl.load(Counts), tl.load(Counts + 1)
    T = S * q
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < T
        i = t // q
        real = live & (i < n)
        sl, bad_len, first = _rows(
            SeqLens, Table, i, live, w, q, W, bs, num_blocks, dummy_block, BLOCK_W
        )
        keep = real & ~(bad_len | (first < W))
        pos = tl.maximum(sl - q + t % q, 0)  # a kept sequence's positions are never negative
        row_id = tl.load(Table + i * W + tl.minimum(pos // bs, W - 1), mask=live, other=0)
        slot = tl.load(Slots + t, mask=live, other=0)
        wrong = slot != row_id.to(tl.int64) * bs + pos % bs
        twice = _twice(Slots, t, slot, n, q, T, t0, BLOCK_T)
        code = tl.where(real, tl.where(wrong, 3, tl.where(twice, 4, 0)), 0).to(tl.int64)
        best, best_code, best_value = _keep_first(
            S + t.to(tl.int64), code, slot, best, best_code, best_value
        )
        good = keep & ~(wrong | twice)
        tl.store(OutSlots + t, tl.where(good, slot, dummy_slot), mask=live)
    return best, best_code, best_value


@triton.jit
def _check_kernel(
    SeqLens,
    Table,
    Slots,
    Counts,
    Error,
    OutSeqLens,
    OutTable,
    OutSlots,
    S,
    q,
    W,
    bs,
    num_blocks,
    dummy_block,
    dummy_slot,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    best, best_code, best_value = _sequences(
        SeqLens,
        Table,
        Counts,
        OutSeqLens,
        OutTable,
        S,
        q,
        W,
        bs,
        num_blocks,
        dummy_block,
        BLOCK_S,
        BLOCK_W,
    )
    best, best_code, best_value = _tokens(
        SeqLens,
        Table,
        Slots,
        Counts,
        OutSlots,
        S,
        q,
        W,
        bs,
        num_blocks,
        dummy_block,
        dummy_slot,
        best,
        best_code,
        best_value,
        BLOCK_T,
        BLOCK_W,
    )
    if (tl.load(Error) == 0) & (best < NONE):  # an earlier step's problem stays
        tl.store(Error, best_code)
        tl.store(Error + 1, tl.where(best < S, best, best - S))
        tl.store(Error + 2, best_value)


def _laid_out(call: CheckCall) -> bool:
    """The buffers as the core lays them out: each of its dtype, the tables' rows full."""
    width = call.table.shape[1]
    rows = call.table.stride() == call.out_table.stride() == (width, 1)
    return rows and all(getattr(call, name).dtype == dtype for name, dtype in _TYPES)


def metadata_check(call: CheckCall) -> bool:
    """`Kernels.metadata_check`: the key's check in one launch (False: declined, see the
    module docstring)."""
    s, q = call.seq_lens.shape[0], call.query_len
    width = call.table.shape[1]
    if not 0 < s * q <= MAX_TOKENS or not _laid_out(call):
        return False
    _check_kernel[(1,)](
        call.seq_lens,
        call.table,
        call.slots,
        call.counts,
        call.error,
        call.out_seq_lens,
        call.out_table,
        call.out_slots,
        s,
        q,
        width,
        call.block_size,
        call.num_blocks,
        call.dummy_block,
        call.dummy_slot,
        BLOCK_S=BLOCK_S,
        BLOCK_W=min(triton.next_power_of_2(width), MAX_BLOCK_W),
        BLOCK_T=BLOCK_T,
        num_warps=4,
    )
    return True
