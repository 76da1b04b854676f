"""Varlen paged prefill attention: every query tile of a step in one launch.

Program (tile, q head) reads its tile's row of the planned table, its sequence's length and
block-table row from device, and attends flash-style over the paged cache (context plus this
step's keys, stored before): whole key tiles every query of the tile sees run without a
causal mask, the rest with one. Query j of a sequence sits at position
seq_len - query_len + j. Programs past the planned tiles zero the bucket-padding rows, so
one launch writes all of `out`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgraph.adapter import KVCache

from . import cdiv, dot_precision, dot_upcast
from .online import load_rows, page_slots, softmax_step
from .tiles import COLUMNS as _COLUMNS

COLUMNS: tl.constexpr = tl.constexpr(_COLUMNS)

LOG2E = 1.4426950408889634


# fmt: off
# Triton kernels take every pointer, stride and tile size as its own argument; one per
# line would bury each kernel under its signature, so these keep them packed.

@triton.jit
def _attend_range(acc, m, den, q, K, V, table_row, lo, hi, qpos, seq_len, scale_log2,
                  s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
                  MASKED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Fold keys [lo, hi) of one kv head into (acc, m, den); MASKED adds the causal and
    context masks (unmasked ranges hold only keys every query row sees)."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        inside = pos < seq_len
        blk, slot = page_slots(table_row, pos, inside, PAGE, MASKED)
        if MASKED:
            lmask = inside[:, None] & dmask[None, :]
        else:
            lmask = dmask[None, :]
        k = load_rows(K, blk, slot, d, lmask, s_kb, s_ks, s_kd)
        v = load_rows(V, blk, slot, d, lmask, s_vb, s_vs, s_vd)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if MASKED:
            seen = (pos[None, :] <= qpos[:, None]) & inside[None, :]
            s = tl.where(seen, s, float("-inf"))
        acc, m, den = softmax_step(acc, m, den, s, v, PRECISION)
    return acc, m, den


@triton.jit
def _attend_tile(Q, K, V, Out, Tiles, SeqLens, Tables, tile, head, scale_log2,
                 s_qt, s_qh, s_qd, s_ot, s_oh, s_od, s_kb, s_ks, s_kd, s_vb, s_vs, s_vd, s_tb,
                 PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr):
    row = Tiles + tile * COLUMNS
    seq = tl.load(row).to(tl.int64)
    q_start = tl.load(row + 1)
    q_len = tl.load(row + 2)
    t_off = tl.load(row + 3)
    seq_len = tl.load(SeqLens + seq)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mask = ((t_off + r) < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    tok = (q_start + t_off + r).to(tl.int64)
    q = tl.load(Q + tok[:, None] * s_qt + head * s_qh + d[None, :] * s_qd, mask=mask, other=0.0)
    q = q.to(K.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)
    first = seq_len - q_len + t_off  # position of the tile's first query
    qpos = first + r
    # keys at positions <= first are seen by every row: whole tiles of them skip the mask
    full = (first + 1) // BLOCK_N * BLOCK_N
    end = tl.minimum(seq_len, first + BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    table_row = Tables + seq * s_tb
    acc, m, den = _attend_range(
        acc, m, den, q, K, V, table_row, 0, full, qpos, seq_len, scale_log2,
        s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
        False, PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
    )
    acc, m, den = _attend_range(
        acc, m, den, q, K, V, table_row, full, end, qpos, seq_len, scale_log2,
        s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
        True, PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
    )
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    o_ptr = Out + tok[:, None] * s_ot + head * s_oh + d[None, :] * s_od
    tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tiles", "num_tokens", "total_rows"])
def _prefill_kernel(Q, K, V, Out, Tiles, SeqLens, Tables, num_tiles, num_tokens, total_rows,
                    scale_log2, s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
                    s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, s_tb,
                    HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid // HEADS  # the q heads of a tile run next to each other: its keys stay in L2
    head = pid % HEADS
    if tile < num_tiles:
        kvh = head // GROUP
        _attend_tile(
            Q, K + kvh * s_kh, V + kvh * s_vh, Out, Tiles, SeqLens, Tables, tile, head,
            scale_log2, s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
            s_kb, s_ks, s_kd, s_vb, s_vs, s_vd, s_tb,
            PAGE, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
        )
    else:
        # bucket padding: rows [num_tokens, total_rows) come back zeroed
        tok = num_tokens + (tile - num_tiles) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = (tok < total_rows)[:, None] & (d < HEAD_DIM)[None, :]
        zero = tl.zeros([BLOCK_M, BLOCK_D], Out.dtype.element_ty)
        tl.store(Out + tok[:, None] * s_ot + head * s_oh + d[None, :] * s_od, zero, mask=mask)


# fmt: on


def varlen_prefill(
    q: torch.Tensor,
    kv_cache: KVCache,
    tiles: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    num_tokens: int,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """out = causal attention of q's first num_tokens rows over the paged cache, tile by
    planned tile (`tiles`: int32 [tiles, COLUMNS] on device, from kernels.tiles); rows past
    num_tokens are zeroed."""
    k_cache, v_cache = kv_cache
    rows, hq, dim = q.shape
    hkv = k_cache.shape[2]
    num_tiles = tiles.shape[0]
    grid = (hq * (num_tiles + cdiv(rows - num_tokens, block_m)),)
    if grid[0] == 0:
        return
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        tiles,
        seq_lens,
        block_tables,
        num_tiles,
        num_tokens,
        rows,
        scale * LOG2E,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        HEADS=hq,
        GROUP=hq // hkv,
        PAGE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(dim),
        HEAD_DIM=dim,
        UPCAST=dot_upcast(),
        PRECISION=dot_precision(k_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
