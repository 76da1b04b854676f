"""Paged decode attention: QLEN query tokens per sequence (1 in decode, 1 + k when k draft
tokens are verified), every per-step value read on device.

Program (query token, kv head, split) loads the q heads of its kv head together (GQA),
reads its sequence's length and block-table row from device tensors and walks only the key
tiles of its share of the context up to its own position (causal: token j of a sequence of
length L sees positions < L - QLEN + 1 + j), so its cost follows the real context, not the
table width. Positions >= seq_len are never loaded (masked loads, -inf
scores), so whatever fills unused or dummy blocks cannot reach the output. With one split
the program writes `out`; with several, each writes a normalized partial and its
log-sum-exp, and a second kernel merges them, or (`counts` given) the last split of each
(token, kv head) to finish merges them itself (`fixup`: in split order, so replays are
bitwise repeatable), and one launch does it all. With `store` (decode, one query token per
sequence), the split that holds the token's own position first writes the token's k and v
at its slot, then walks the cache (a barrier between: its own threads read them back), so
the step's store needs no launch of its own either; under PDL such a launch may read its
sequence's length, table entries and first key tile before it waits for its predecessor
(`preload`: nothing the kernel before it writes is among them), the tile then patched with
the row it stores. The launch shape depends only on tensor shapes, so the launches record
into a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from xgraph.adapter import KVCache

from . import dot_precision, dot_upcast, pdl_options, sm_count
from .fixup import arrive
from .online import load_rows, page_slots, softmax_step

LOG2E = 1.4426950408889634


def decode_preload() -> bool:
    """XGRAPH_CUDA_DECODE_PRELOAD (on by default; off): under PDL the one-launch decode
    attention reads its sequence's length, block-table entries and first key/value tile
    before it waits for the kernel before it (docs/kernels.md)."""
    return os.environ.get("XGRAPH_CUDA_DECODE_PRELOAD", "on").strip().lower() != "off"


def preloads(waits: bool, store: bool, programs: int, sms: int) -> bool:
    """Whether a launch loads its first key tile before its wait: with the wait compiled in,
    a store of its own and the switch on, where its (token, kv head) programs are fewer
    than the SMs. A launch with more is the one that splits no context: it keeps the SMs
    busy by itself, and the tile's registers cost it more than the overlap gives (an H100,
    Qwen3-0.6B batch 64: 2% slower with it; batch 8: 5% faster)."""
    return waits and store and decode_preload() and programs < sms


# fmt: off
# Triton kernels take every pointer, stride and tile size as its own argument; one per
# line would bury each kernel under its signature, so these keep them packed.

@triton.jit
def _tile(K, V, table_row, table_width, start, hi, s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
          HEAD_DIM: tl.constexpr):
    """Key positions [start, start + BLOCK_N) below hi of one kv head: (k, v rows as the
    cache holds them, which positions are valid, each row's slot in the cache)."""
    d = tl.arange(0, BLOCK_D)
    pos = start + tl.arange(0, BLOCK_N)
    valid = (pos < hi) & (pos // PAGE < table_width)
    blk, slot = page_slots(table_row, pos, valid, PAGE, True)
    lmask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = load_rows(K, blk, slot, d, lmask, s_kb, s_ks, s_kd)
    v = load_rows(V, blk, slot, d, lmask, s_vb, s_vs, s_vd)
    return k, v, valid, blk * PAGE + slot


@triton.jit
def _fold(acc, m, den, q, k, v, valid, scale_log2, UPCAST: tl.constexpr,
          PRECISION: tl.constexpr):
    """One key tile into the online softmax of q."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    return softmax_step(acc, m, den, s, v, PRECISION)


@triton.jit
def _walk(q, K, V, table_row, table_width, lo, hi, scale_log2, k0, v0, valid0,
          s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
          PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
          PRECISION: tl.constexpr, PRELOAD: tl.constexpr):
    """Online softmax of q [BLOCK_G, BLOCK_D] over key positions [lo, hi) of one kv head
    (K, V point at it): (acc, running max, denominator). PRELOAD: the first tile is (k0, v0,
    valid0), loaded before the program waited."""
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    first = lo
    if PRELOAD:
        if lo < hi:  # an empty share folds nothing (a tile of no valid key would give NaN)
            acc, m, den = _fold(acc, m, den, q, k0, v0, valid0, scale_log2, UPCAST, PRECISION)
        first = lo + BLOCK_N
    for start in range(first, hi, BLOCK_N):
        k, v, valid, _ = _tile(K, V, table_row, table_width, start, hi,
                               s_kb, s_ks, s_kd, s_vb, s_vs, s_vd, PAGE, BLOCK_N, BLOCK_D,
                               HEAD_DIM)
        acc, m, den = _fold(acc, m, den, q, k, v, valid, scale_log2, UPCAST, PRECISION)
    return acc, m, den


@triton.jit
def _store_own(Knew, Vnew, K, V, Slots, b, h, num_slots, mine, d, dmask,
               s_nb, s_nh, s_mb, s_mh, s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
               PAGE: tl.constexpr):
    """Write token b's k and v of kv head h (K, V point at it) at its slot, if `mine`; a slot
    outside the cache is dropped rather than written past its end. Returns (k, v as stored,
    the slot, whether they were stored)."""
    slot = tl.load(Slots + b).to(tl.int64)
    ok = dmask & mine & (slot >= 0) & (slot < num_slots)
    blk, off = slot // PAGE, slot % PAGE
    k = tl.load(Knew + b * s_nb + h * s_nh + d, mask=ok, other=0.0).to(K.dtype.element_ty)
    v = tl.load(Vnew + b * s_mb + h * s_mh + d, mask=ok, other=0.0).to(V.dtype.element_ty)
    tl.store(K + blk * s_kb + off * s_ks + d * s_kd, k, mask=ok)
    tl.store(V + blk * s_vb + off * s_vs + d * s_vd, v, mask=ok)
    tl.debug_barrier()  # the walk's loads of this slot come after these stores
    return k, v, slot, ok


@triton.jit
def _patched(tile, row, tile_slots, slot, stored):
    """A tile loaded before the store with the stored row put where its slot was: what a
    load after the store would have read."""
    own = (tile_slots == slot)[:, None] & stored[None, :]
    return tl.where(own, row[None, :], tile)


@triton.jit
def _merge_here(Part, Lse, Out, b, heads, hq, qmask, d, gmask, s_ob, s_oh, s_od,
                SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Out[b, heads] from the splits' partials, weighted by their share of the softmax mass,
    in split order (the last split to finish runs this)."""
    row = (b * hq + heads) * SPLITS
    top = tl.full(heads.shape, float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(Lse + row + s, mask=gmask, other=float("-inf"),
                                      cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros(qmask.shape, tl.float32)
    total = tl.zeros(heads.shape, tl.float32)
    for s in tl.static_range(SPLITS):
        w = tl.exp2(tl.load(Lse + row + s, mask=gmask, other=float("-inf"),
                            cache_modifier=".cg") - top)
        part = tl.load(Part + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=qmask, other=0.0,
                       cache_modifier=".cg")
        acc += part * w[:, None]
        total += w
    o = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(Out + b * s_ob + heads[:, None] * s_oh + d[None, :] * s_od,
             o.to(Out.dtype.element_ty), mask=qmask)


@triton.jit
def _finish(acc, m, den, Out, Part, Lse, Count, b, h, split, heads, qmask, d, gmask,
            s_ob, s_oh, s_od, GROUP: tl.constexpr, SPLITS: tl.constexpr,
            HEAD_DIM: tl.constexpr, FIXUP: tl.constexpr):
    """The program's result: `out` with one split; else its normalized partial and
    log-sum-exp, and with FIXUP the merge by the last split to finish."""
    # an empty share (or seq_len 0) has den == 0: it writes zeros and a -inf log-sum-exp
    safe = tl.where(den > 0, den, 1.0)
    o = acc / safe[:, None]
    if SPLITS == 1:
        o_ptr = Out + b * s_ob + heads[:, None] * s_oh + d[None, :] * s_od
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=qmask)
    else:
        hq = tl.num_programs(1) * GROUP
        row = (b * hq + heads) * SPLITS + split  # Part [b, hq, S, D]
        tl.store(Part + row[:, None] * HEAD_DIM + d[None, :], o, mask=qmask)
        lse = tl.where(den > 0, m + tl.log2(safe), float("-inf"))
        tl.store(Lse + row, lse, mask=gmask)
        if FIXUP:
            if arrive(Count, b * tl.num_programs(1) + h, SPLITS):
                _merge_here(Part, Lse, Out, b, heads, hq, qmask, d, gmask,
                            s_ob, s_oh, s_od, SPLITS, HEAD_DIM)


@triton.jit
def _decode_kernel(Q, K, V, Out, Part, Lse, SeqLens, Tables, table_width, scale_log2,
                   s_qb, s_qh, s_qd, s_ob, s_oh, s_od,
                   s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, s_tb,
                   Knew, Vnew, Slots, num_slots, s_nb, s_nh, s_mb, s_mh, Count,
                   GROUP: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr, QLEN: tl.constexpr, STORE: tl.constexpr,
                   FIXUP: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # the query token
    h = tl.program_id(1)
    split = tl.program_id(2)
    seq = b // QLEN
    if PDL and not PRELOAD:  # nothing the previous kernel writes is read or written before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # the keys this token sees: its sequence's, up to and including its own position
    seq_len = tl.load(SeqLens + seq) - (QLEN - 1 - b % QLEN)
    # whole key tiles per split, so a short context keeps to the first few splits
    share = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * share
    hi = tl.minimum(lo + share, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = h * GROUP + g
    qmask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    table_row = Tables + seq * s_tb
    # PRELOAD (with STORE only: this kernel writes the step's keys, so the cache and the
    # metadata it reads first were written before its predecessor ran): the first key tile
    # is in flight while the previous kernel finishes (without it nothing reads the tile
    # and the compiler drops its loads)
    k0, v0, valid0, slots0 = _tile(K + h * s_kh, V + h * s_vh, table_row, table_width, lo, hi,
                                   s_kb, s_ks, s_kd, s_vb, s_vs, s_vd, PAGE, BLOCK_N, BLOCK_D,
                                   HEAD_DIM)
    if PDL and PRELOAD:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if STORE:  # the split holding the token's own position (split 0 of an empty context)
        owner = tl.where(seq_len > 0, (seq_len - 1) // tl.maximum(share, 1), 0)
        k_own, v_own, slot, stored = _store_own(
            Knew, Vnew, K + h * s_kh, V + h * s_vh, Slots, b, h, num_slots, split == owner, d,
            d < HEAD_DIM, s_nb, s_nh, s_mb, s_mh, s_kb, s_ks, s_kd, s_vb, s_vs, s_vd, PAGE)
        if PRELOAD:
            tile_slots = tl.where(valid0, slots0, -1)
            k0 = _patched(k0, k_own, tile_slots, slot, stored)
            v0 = _patched(v0, v_own, tile_slots, slot, stored)
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :] * s_qd, mask=qmask, other=0.0)
    q = q.to(K.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)
    acc, m, den = _walk(
        q, K + h * s_kh, V + h * s_vh, table_row, table_width, lo, hi, scale_log2,
        k0, v0, valid0, s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
        PAGE, BLOCK_G, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST, PRECISION, PRELOAD,
    )
    _finish(acc, m, den, Out, Part, Lse, Count, b, h, split, heads, qmask, d, g < GROUP,
            s_ob, s_oh, s_od, GROUP, SPLITS, HEAD_DIM, FIXUP)


@triton.jit
def _merge_kernel(Part, Lse, Out, s_ob, s_oh, s_od,
                  SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """Out[b, h] = the splits' partials weighted by their share of the softmax mass."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * tl.num_programs(1) + h) * SPLITS + s
    smask = s < SPLITS
    lse = tl.load(Lse + row, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    part = tl.load(Part + row[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * s_ob + h * s_oh + d * s_od, o.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


# fmt: on


def _partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's normalized output and log-sum-exp (unused with one split)."""
    if splits == 1:
        return out, out
    b, hq, dim = out.shape
    part = torch.empty((b, hq, splits, dim), dtype=torch.float32, device=out.device)
    return part, torch.empty((b, hq, splits), dtype=torch.float32, device=out.device)


def _leading_args(
    q: torch.Tensor,
    kv_cache: KVCache,
    out: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor],
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
) -> tuple:
    """The kernel's arguments up to its store's: the tensors, the table width, the scale in
    base 2, then q's, out's, the caches' and the table's strides."""
    k_cache, v_cache = kv_cache
    return (
        q,
        k_cache,
        v_cache,
        out,
        *partials,
        seq_lens,
        tables,
        tables.shape[1],
        scale * LOG2E,
        *q.stride(),
        *out.stride(),
        *k_cache.stride()[:4],
        *v_cache.stride()[:4],
        tables.stride(0),
    )


def _store_args(
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    k_cache: torch.Tensor,
    q: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple:
    """The kernel's store arguments: new k, v, slots, the cache's slot count, k's and v's
    token and head strides (stand-ins without a store)."""
    knew, vnew, slots = store if store is not None else (q, q, seq_lens)
    slots_total = k_cache.shape[0] * k_cache.shape[1]
    return (knew, vnew, slots, slots_total, *knew.stride()[:2], *vnew.stride()[:2])


def paged_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    splits: int,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    query_len: int = 1,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    counts: torch.Tensor | None = None,
    pdl: dict | None = None,
    preload: bool | None = None,
) -> None:
    """out[t] = attention of q[t] [hq, dim] (token t = s * query_len + j) over the first
    seq_lens[s] - query_len + 1 + j positions of sequence s, `splits` programs per (token, kv
    head); `store` = (k, v, slots): k[t], v[t] written at slots[t] first (query_len 1);
    `counts` (the arena): the splits merge themselves, no second kernel. `preload`: each
    program reads its first key tile before its PDL wait (None: as `preloads` decides)."""
    k_cache = kv_cache[0]
    (b, hq, dim), hkv = q.shape, k_cache.shape[2]
    pdl = pdl or pdl_options()
    if preload is None:
        preload = preloads(bool(pdl["PDL"]), store is not None, b * hkv, sm_count(q.device))
    group, block_d = hq // hkv, triton.next_power_of_2(dim)
    part, lse = _partials(out, splits)
    _decode_kernel[(b, hkv, splits)](
        *_leading_args(q, kv_cache, out, (part, lse), seq_lens, block_tables, scale),
        *_store_args(store, k_cache, q, seq_lens),
        counts if counts is not None else seq_lens,
        GROUP=group,
        PAGE=k_cache.shape[1],
        SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HEAD_DIM=dim,
        UPCAST=dot_upcast(),
        PRECISION=dot_precision(k_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        QLEN=query_len,
        STORE=store is not None,
        FIXUP=counts is not None,
        PRELOAD=preload and store is not None,
        **pdl,
    )
    if splits > 1 and counts is None:
        _merge(part, lse, out, splits, block_d, dim)


def _merge(
    part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int, block_d: int, dim: int
) -> None:
    """out[b, h] from the splits' partials and log-sum-exps."""
    b, hq = out.shape[0], out.shape[1]
    _merge_kernel[(b, hq)](
        part,
        lse,
        out,
        *out.stride(),
        SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
        HEAD_DIM=dim,
        num_warps=1 if dim <= 128 else 2,
    )
