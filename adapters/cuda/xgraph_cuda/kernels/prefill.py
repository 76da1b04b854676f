"""Varlen paged prefill attention with the step's k/v store fused in: one launch per layer.

Program (tile, q head) reads its tile's row of the planned table and its sequence's
block-table row from device and attends flash-style: the context keys (positions below the
tile's context length) come from the paged cache, the step's own keys straight from the k/v
inputs (the sequence's rows), so the launch never reads a cache slot it writes. Whole key
tiles every query of the tile sees run without a causal mask, the rest with one. Query j of
a sequence sits at position context + j. The first q-head program of each kv head also
writes its tile's k/v rows of that head at their slots, so every real token is stored once.
Programs past the planned tiles zero the bucket-padding rows: one launch writes all of
`out` and the cache.

Strides are constexprs (fixed for a model, the same for every bucket); token and tile counts
are runtime values left unspecialized, so new batch shapes never recompile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xgraph.metadata import KVCache

from . import dot_precision, dot_upcast
from .online import load_rows, page_slots, softmax_step
from .tiles import COLUMNS as _COLUMNS

COLUMNS: tl.constexpr = tl.constexpr(_COLUMNS)

LOG2E = 1.4426950408889634


@triton.jit
def _fold(acc, m, den, q, k, v, seen, scale_log2, MASKED: tl.constexpr,
          UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One key tile (k, v in the cache dtype) into (acc, m, den); `seen` masks when MASKED."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASKED:
        s = tl.where(seen, s, float("-inf"))
    return softmax_step(acc, m, den, s, v, PRECISION)


@triton.jit
def _attend_cache(acc, m, den, q, KC, VC, table_row, lo, hi, ctx, scale_log2,
                  SKC_B: tl.constexpr, SKC_S: tl.constexpr, SKC_D: tl.constexpr,
                  SVC_B: tl.constexpr, SVC_S: tl.constexpr, SVC_D: tl.constexpr,
                  MASKED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr):  # fmt: skip
    """Cached context keys [lo, hi) of one kv head: every query row sees all of them, so
    MASKED only bounds the last tile at ctx."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        inside = pos < ctx
        blk, slot = page_slots(table_row, pos, inside, PAGE, MASKED)
        if MASKED:
            lmask = inside[:, None] & dmask[None, :]
        else:
            lmask = dmask[None, :]
        k = load_rows(KC, blk, slot, d, lmask, SKC_B, SKC_S, SKC_D)
        v = load_rows(VC, blk, slot, d, lmask, SVC_B, SVC_S, SVC_D)
        acc, m, den = _fold(
            acc, m, den, q, k, v, inside[None, :], scale_log2, MASKED, UPCAST, PRECISION
        )
    return acc, m, den


@triton.jit
def _attend_new(acc, m, den, q, K, V, KC, row0, lo, hi, qj, scale_log2,
                SK_T: tl.constexpr, SK_D: tl.constexpr, SV_T: tl.constexpr,
                SV_D: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr):  # fmt: skip
    """The step's own keys j in [lo, hi) of one kv head, read from the k/v inputs (rows
    row0 + j) and rounded to the cache dtype, as a read back from the cache would be;
    MASKED adds the causal mask (query j' sees keys j <= j')."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        inside = j < hi
        rows = (row0 + j).to(tl.int64)
        if MASKED:
            lmask = inside[:, None] & dmask[None, :]
        else:
            lmask = dmask[None, :]
        k = tl.load(K + rows[:, None] * SK_T + d[None, :] * SK_D, mask=lmask, other=0.0)
        v = tl.load(V + rows[:, None] * SV_T + d[None, :] * SV_D, mask=lmask, other=0.0)
        k = k.to(KC.dtype.element_ty)
        v = v.to(KC.dtype.element_ty)
        seen = (j[None, :] <= qj[:, None]) & inside[None, :]
        acc, m, den = _fold(acc, m, den, q, k, v, seen, scale_log2, MASKED, UPCAST, PRECISION)
    return acc, m, den


@triton.jit
def _store_rows(K, V, KC, VC, Slots, tok, rmask,
                SK_T: tl.constexpr, SK_D: tl.constexpr, SV_T: tl.constexpr,
                SV_D: tl.constexpr, SKC_B: tl.constexpr, SKC_S: tl.constexpr,
                SKC_D: tl.constexpr, SVC_B: tl.constexpr, SVC_S: tl.constexpr,
                SVC_D: tl.constexpr, PAGE: tl.constexpr, NUM_SLOTS: tl.constexpr,
                BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """Rows `tok` of one kv head's k and v written at their slots. A slot outside the cache
    is dropped rather than written past its end (the executor has checked every slot; this
    only keeps a bad direct call from corrupting memory)."""
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(Slots + tok, mask=rmask, other=-1).to(tl.int64)
    ok = rmask & (slot >= 0) & (slot < NUM_SLOTS)
    mask = ok[:, None] & (d < HEAD_DIM)[None, :]
    blk = (slot // PAGE)[:, None]
    off = (slot % PAGE)[:, None]
    k = tl.load(K + tok[:, None] * SK_T + d[None, :] * SK_D, mask=mask)
    v = tl.load(V + tok[:, None] * SV_T + d[None, :] * SV_D, mask=mask)
    kc = KC + blk * SKC_B + off * SKC_S + d[None, :] * SKC_D
    vc = VC + blk * SVC_B + off * SVC_S + d[None, :] * SVC_D
    tl.store(kc, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(VC.dtype.element_ty), mask=mask)


@triton.jit
def _attend_keys(q, K, V, KC, VC, table_row, ctx, q_start, t_off, q_len, qj, scale_log2,
                 SK_T: tl.constexpr, SK_D: tl.constexpr, SV_T: tl.constexpr,
                 SV_D: tl.constexpr, SKC_B: tl.constexpr, SKC_S: tl.constexpr,
                 SKC_D: tl.constexpr, SVC_B: tl.constexpr, SVC_S: tl.constexpr,
                 SVC_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Attention of a tile's queries over the context, then over the step's keys."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    cfull = ctx // BLOCK_N * BLOCK_N
    acc, m, den = _attend_cache(
        acc, m, den, q, KC, VC, table_row, 0, cfull, ctx, scale_log2,
        SKC_B, SKC_S, SKC_D, SVC_B, SVC_S, SVC_D,
        False, PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
    )  # fmt: skip
    acc, m, den = _attend_cache(
        acc, m, den, q, KC, VC, table_row, cfull, ctx, ctx, scale_log2,
        SKC_B, SKC_S, SKC_D, SVC_B, SVC_S, SVC_D,
        True, PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
    )  # fmt: skip
    # the step's keys j <= t_off are seen by every row: whole tiles of them skip the mask
    jfull = (t_off + 1) // BLOCK_N * BLOCK_N
    jend = tl.minimum(q_len, t_off + BLOCK_M)
    acc, m, den = _attend_new(
        acc, m, den, q, K, V, KC, q_start, 0, jfull, qj, scale_log2, SK_T, SK_D, SV_T, SV_D,
        False, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
    )  # fmt: skip
    acc, m, den = _attend_new(
        acc, m, den, q, K, V, KC, q_start, jfull, jend, qj, scale_log2, SK_T, SK_D, SV_T, SV_D,
        True, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
    )  # fmt: skip
    return acc / tl.where(den > 0, den, 1.0)[:, None]


@triton.jit
def _attend_tile(Q, K, V, Out, KC, VC, Tiles, Tables, Slots, tile, store, s_tb, scale_log2,
                 SQ_T: tl.constexpr, SQ_D: tl.constexpr, SO_T: tl.constexpr,
                 SO_D: tl.constexpr, SK_T: tl.constexpr, SK_D: tl.constexpr,
                 SV_T: tl.constexpr, SV_D: tl.constexpr, SKC_B: tl.constexpr,
                 SKC_S: tl.constexpr, SKC_D: tl.constexpr, SVC_B: tl.constexpr,
                 SVC_S: tl.constexpr, SVC_D: tl.constexpr, PAGE: tl.constexpr,
                 NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr):  # fmt: skip
    """One planned tile for one q head (Q, Out, K, V, KC, VC point at its heads)."""
    row = Tiles + tile * COLUMNS
    seq = tl.load(row).to(tl.int64)
    q_start = tl.load(row + 1)
    q_len = tl.load(row + 2)
    t_off = tl.load(row + 3)
    ctx = tl.load(row + 4)
    qj = t_off + tl.arange(0, BLOCK_M)  # the tile's queries, as indexes into the sequence
    rmask = qj < q_len
    tok = (q_start + qj).to(tl.int64)
    if store:
        _store_rows(K, V, KC, VC, Slots, tok, rmask, SK_T, SK_D, SV_T, SV_D, SKC_B, SKC_S,
                    SKC_D, SVC_B, SVC_S, SVC_D, PAGE, NUM_SLOTS, BLOCK_D, HEAD_DIM)  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(Q + tok[:, None] * SQ_T + d[None, :] * SQ_D, mask=mask, other=0.0)
    q = q.to(KC.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)
    o = _attend_keys(
        q, K, V, KC, VC, Tables + seq * s_tb, ctx, q_start, t_off, q_len, qj, scale_log2,
        SK_T, SK_D, SV_T, SV_D, SKC_B, SKC_S, SKC_D, SVC_B, SVC_S, SVC_D,
        PAGE, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
    )  # fmt: skip
    tl.store(Out + tok[:, None] * SO_T + d[None, :] * SO_D, o.to(Out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tiles", "num_tokens", "total_rows", "s_tb"])
def _prefill_kernel(Q, K, V, Out, KC, VC, Tiles, Tables, Slots,
                    num_tiles, num_tokens, total_rows, s_tb, scale_log2,
                    SQ_T: tl.constexpr, SQ_H: tl.constexpr, SQ_D: tl.constexpr,
                    SO_T: tl.constexpr, SO_H: tl.constexpr, SO_D: tl.constexpr,
                    SK_T: tl.constexpr, SK_H: tl.constexpr, SK_D: tl.constexpr,
                    SV_T: tl.constexpr, SV_H: tl.constexpr, SV_D: tl.constexpr,
                    SKC_B: tl.constexpr, SKC_S: tl.constexpr, SKC_H: tl.constexpr,
                    SKC_D: tl.constexpr, SVC_B: tl.constexpr, SVC_S: tl.constexpr,
                    SVC_H: tl.constexpr, SVC_D: tl.constexpr, HEADS: tl.constexpr,
                    GROUP: tl.constexpr, PAGE: tl.constexpr, NUM_SLOTS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    tile = pid // HEADS  # the q heads of a tile run next to each other: its keys stay in L2
    head = pid % HEADS
    if tile < num_tiles:
        kvh = head // GROUP
        _attend_tile(
            Q + head * SQ_H, K + kvh * SK_H, V + kvh * SV_H, Out + head * SO_H,
            KC + kvh * SKC_H, VC + kvh * SVC_H, Tiles, Tables, Slots, tile,
            head % GROUP == 0, s_tb, scale_log2, SQ_T, SQ_D, SO_T, SO_D, SK_T, SK_D,
            SV_T, SV_D, SKC_B, SKC_S, SKC_D, SVC_B, SVC_S, SVC_D, PAGE, NUM_SLOTS,
            BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION,
        )  # fmt: skip
    else:
        # bucket padding: rows [num_tokens, total_rows) come back zeroed
        tok = num_tokens + (tile - num_tiles) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = (tok < total_rows)[:, None] & (d < HEAD_DIM)[None, :]
        zero = tl.zeros([BLOCK_M, BLOCK_D], Out.dtype.element_ty)
        tl.store(Out + tok[:, None] * SO_T + head * SO_H + d[None, :] * SO_D, zero, mask=mask)


@dataclass
class PrefillStep:
    """What one step's launches read besides the layer's tensors (set by plan())."""

    tiles: torch.Tensor  # int32 [>= num_tiles, COLUMNS] on device
    num_tiles: int
    slots: torch.Tensor
    block_tables: torch.Tensor
    table_stride: int  # block_tables.stride(0)
    num_tokens: int


class PrefillLaunch:
    """The prefill launch for one tensor layout: constexprs (strides, sizes, flags) and the
    config worked out once, so a call only computes the grid and launches."""

    __slots__ = ("block_m", "consts", "heads", "k_rows", "page", "rows")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 kv_cache: KVCache, block_m: int, block_n: int, num_warps: int,
                 num_stages: int) -> None:  # fmt: skip
        k_cache, v_cache = kv_cache
        self.rows, self.heads, dim = q.shape
        self.k_rows, self.block_m, self.page = k.shape[0], block_m, k_cache.shape[1]
        names = ("SQ", "SO", "SK", "SV", "SKC", "SVC")
        tensors = (q, out, k, v, k_cache, v_cache)
        consts = {f"{n}_{a}": s for n, t in zip(names, tensors) for a, s in _strides(t)}
        self.consts = consts | {
            "HEADS": self.heads, "GROUP": self.heads // k_cache.shape[2], "PAGE": self.page,
            "NUM_SLOTS": k_cache.shape[0] * self.page, "BLOCK_M": block_m, "BLOCK_N": block_n,
            "BLOCK_D": triton.next_power_of_2(dim), "HEAD_DIM": dim, "UPCAST": dot_upcast(),
            "PRECISION": dot_precision(k_cache.dtype), "num_warps": num_warps,
            "num_stages": num_stages,
        }  # fmt: skip

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 kv_cache: KVCache, step: PrefillStep, scale: float) -> None:  # fmt: skip
        pad = (self.rows - step.num_tokens + self.block_m - 1) // self.block_m
        programs = self.heads * (step.num_tiles + pad)
        if programs:
            _prefill_kernel[(programs,)](
                q, k, v, out, kv_cache[0], kv_cache[1], step.tiles, step.block_tables,
                step.slots, step.num_tiles, step.num_tokens, self.rows, step.table_stride,
                scale * LOG2E,
                **self.consts,
            )  # fmt: skip


def _strides(t: torch.Tensor) -> list[tuple[str, int]]:
    """A tensor's strides by axis letter: [tokens, heads, dim] or [blocks, slots, heads, dim]."""
    axes = "THD" if t.dim() == 3 else "BSHD"
    return list(zip(axes, t.stride()))


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   kv_cache: KVCache, step: PrefillStep, scale: float, block_m: int,
                   block_n: int, num_warps: int = 4, num_stages: int = 1) -> None:  # fmt: skip
    """Store rows [0, step.num_tokens) of k, v at their slots and write out = causal
    attention of those rows of q over the context and themselves, tile by planned tile
    (kernels.tiles); rows of out past num_tokens are zeroed. One launch."""
    launch = PrefillLaunch(q, k, v, out, kv_cache, block_m, block_n, num_warps, num_stages)
    launch(q, k, v, out, kv_cache, step, scale)
