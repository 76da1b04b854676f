"""The merged qkv projection of a decode layer in one launch: the input RMSNorm before it, the
per-head QK-norm and neox rotary after it.

Program (head, split) owns one head's head_dim output columns, as two halves of head_dim / 2
(two accumulators over one K loop): the rotary pairs column c with c + head_dim / 2, so
the halves are exactly what it combines, with no shuffle. With a split the head's last
program sums the partials (`fixup`). The epilogue of a q or k head scales by the input's
1 / rms, norms the head (its mean square over head_dim), multiplies the norm weight and
rotates by the token's cos / signed-sin row; a v head is stored as it is. The output is
[tokens, heads + 2 * kv_heads, head_dim], the layout of the unfused projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launcher, prefetch
from .fixup import arrive, gather, gather_row, publish, publish_row, slot
from .gemv import Recipe, k_share, partials, shared_options, workspace
from .operand import accumulate, input_tile, weight_tile
from .tuning import Config

# fmt: off
# Triton kernels take every pointer, stride and tile size as its own argument; one per line
# would bury each kernel under its signature (as in decode.py), so these keep them packed.

@triton.jit
def _head_epilogue(Y, QW, KW, CS, head, rm, m_ok, lo, hi, ss, K, eps, head_eps, s_ym, s_cs,
                   HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                   NORM: tl.constexpr):
    """Store head `head` of the tokens rm from its two halves' products [HALF, rows]."""
    c = tl.arange(0, HALF)
    if NORM:
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        lo = lo * rstd[None, :]
        hi = hi * rstd[None, :]
    if head < HQ + HKV:  # q or k: per-head RMSNorm, then rotary
        is_q = head < HQ
        w_lo = tl.where(is_q, tl.load(QW + c), tl.load(KW + c)).to(tl.float32)
        w_hi = tl.where(is_q, tl.load(QW + HALF + c), tl.load(KW + HALF + c)).to(tl.float32)
        var = (tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / (2 * HALF)
        r = 1.0 / tl.sqrt(var + head_eps)
        lo = lo * r[None, :] * w_lo[:, None]
        hi = hi * r[None, :] * w_hi[:, None]
        row = CS + rm[None, :].to(tl.int64) * s_cs
        m2 = m_ok[None, :]
        cos_lo = tl.load(row + c[:, None], mask=m2, other=0.0)
        cos_hi = tl.load(row + HALF + c[:, None], mask=m2, other=0.0)
        sin_lo = tl.load(row + 2 * HALF + c[:, None], mask=m2, other=0.0)
        sin_hi = tl.load(row + 3 * HALF + c[:, None], mask=m2, other=0.0)
        lo, hi = lo * cos_lo + hi * sin_lo, hi * cos_hi + lo * sin_hi
    out = Y + rm[None, :] * s_ym + head * (2 * HALF) + c[:, None]
    mask = m_ok[None, :]
    tl.store(out, lo.to(Y.dtype.element_ty), mask=mask)
    tl.store(out + HALF, hi.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _pair(lo, hi, ss, w_lo, w_hi, X, G, rm, k, m_ok, K, s_xm, BLOCK_M: tl.constexpr,
          NORM: tl.constexpr, MMA: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr,
          PRECISION: tl.constexpr):
    """One K tile of both halves: the input tile at k against weight tiles w_lo and w_hi."""
    x, sq = input_tile(X, G, rm, k, m_ok, K, s_xm, BLOCK_M, NORM, False, EVEN)
    lo = accumulate(lo, w_lo, x, MMA, UPCAST, PRECISION)
    return lo, accumulate(hi, w_hi, x, MMA, UPCAST, PRECISION), ss + sq


@triton.jit
def _halves(X, W, G, rows, rm, m_ok, k, K, k_per, s_xm, s_wn, ahead_lo, ahead_hi,
            BLOCK_M: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr,
            NORM: tl.constexpr, MMA: tl.constexpr, EVEN: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, PRELOAD: tl.constexpr):
    """One program's share of a head: the products of its two halves of weight rows (`rows`,
    `rows + HALF`) over k_per columns of K from k, and the input's sum of squares (PRELOAD:
    the halves' first PRELOAD tiles are ahead_lo's and ahead_hi's, loaded before the program
    waited)."""
    n_ok = tl.full([HALF], True, tl.int1)
    lo = tl.zeros([HALF, BLOCK_M], tl.float32)
    hi = tl.zeros([HALF, BLOCK_M], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for i in tl.static_range(PRELOAD):
        lo, hi, ss = _pair(lo, hi, ss, ahead_lo[i], ahead_hi[i], X, G, rm, k, m_ok, K, s_xm,
                           BLOCK_M, NORM, MMA, EVEN, UPCAST, PRECISION)
        k += BLOCK_K
    for _ in range(PRELOAD * BLOCK_K, k_per, BLOCK_K):
        w_lo = weight_tile(W, rows, k, n_ok, K, s_wn, EVEN)
        w_hi = weight_tile(W, rows + HALF, k, n_ok, K, s_wn, EVEN)
        lo, hi, ss = _pair(lo, hi, ss, w_lo, w_hi, X, G, rm, k, m_ok, K, s_xm, BLOCK_M, NORM,
                           MMA, EVEN, UPCAST, PRECISION)
        k += BLOCK_K
    return lo, hi, ss


@triton.jit
def _qkv_kernel(X, W, Y, G, QW, KW, CS, Part, Count, M, K, k_per, k_pre, s_xm, s_wn, s_ym,
                s_cs, eps, head_eps,
                HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                NORM: tl.constexpr, MMA: tl.constexpr, EVEN: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                PREFETCH: tl.constexpr, LINE: tl.constexpr, TRIGGER: tl.constexpr,
                PRELOAD: tl.constexpr):
    head = tl.program_id(0)
    split = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rows = head.to(tl.int64) * (2 * HALF) + tl.arange(0, HALF)
    k = split * k_per + tl.arange(0, BLOCK_K)
    n_ok = tl.full([HALF], True, tl.int1)
    ahead_lo = prefetch.tiles_ahead(W, rows, k, n_ok, K, s_wn, BLOCK_K, EVEN, PRELOAD)
    ahead_hi = prefetch.tiles_ahead(W, rows + HALF, k, n_ok, K, s_wn, BLOCK_K, EVEN, PRELOAD)
    # nothing the previous kernel writes is read, nor anything written, before this
    prefetch.enter(W, head.to(tl.int64) * (2 * HALF) + tl.arange(0, 2 * HALF),
                   tl.full([2 * HALF], True, tl.int1), split * k_per, k_pre, K, s_wn, BLOCK_K,
                   LINE, PREFETCH, PDL, TRIGGER)
    lo, hi, ss = _halves(X, W, G, rows, rm, m_ok, k, K, k_per, s_xm, s_wn, ahead_lo, ahead_hi,
                         BLOCK_M, HALF, BLOCK_K, NORM, MMA, EVEN, UPCAST, PRECISION, PRELOAD)
    prefetch.leave(PDL, TRIGGER)
    if SPLIT == 1:
        _head_epilogue(Y, QW, KW, CS, head, rm, m_ok, lo, hi, ss, K, eps, head_eps, s_ym, s_cs,
                       HQ, HKV, HALF, NORM)
    else:
        at = slot(Part, head, split, SPLIT, 2 * HALF + 1, BLOCK_M)
        publish(at, lo, 0, HALF, BLOCK_M)
        publish(at, hi, HALF, HALF, BLOCK_M)
        publish_row(at, ss, 2 * HALF, BLOCK_M)
        if arrive(Count, head, SPLIT):
            lo = gather(Part, head, 0, SPLIT, 2 * HALF + 1, HALF, BLOCK_M)
            hi = gather(Part, head, HALF, SPLIT, 2 * HALF + 1, HALF, BLOCK_M)
            ss = gather_row(Part, head, 2 * HALF, SPLIT, 2 * HALF + 1, BLOCK_M)
            _head_epilogue(Y, QW, KW, CS, head, rm, m_ok, lo, hi, ss, K, eps, head_eps, s_ym,
                           s_cs, HQ, HKV, HALF, NORM)

# fmt: on


def recipe(
    x: torch.Tensor,
    w: torch.Tensor,
    c: Config,
    split_ok: bool,
    heads: tuple[int, int, int],
    *,
    norm: bool = False,
    pdl: dict | None = None,
) -> Recipe:
    """The launch of configuration `c` (its column tile set to a head) over x's rows
    (`split_ok`: the arena's counts are there), for `heads` (head_dim, hq, hkv), with a
    norm prologue or not, under `pdl` (PDL's options, default off)."""
    d, hq, hkv = heads
    k = w.shape[1]
    c = c._replace(block_n=d)
    per, split = k_share(k, c if split_ok else c._replace(split=1))
    tiles = hq + 2 * hkv
    pre, options = shared_options(x, w, c, per, split, norm, pdl)
    meta = {"HQ": hq, "HKV": hkv, "HALF": d // 2, **options}
    # the output in w's dtype: x may be the float32 stream
    return Recipe((tiles, split), per, pre, w.dtype, partials(tiles, split, d + 1, c), meta)


def go(
    r: Recipe,
    x: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor | None,
    heads: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor],
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    compile_only: bool = False,
) -> torch.Tensor:
    """[m, (hq + 2 hkv) * d] as `r` says (made for these arguments' kind). `heads`: (q norm
    weight, k norm weight, eps, cos_sin [m, 2, d] float32)."""
    qw, kw, head_eps, cos_sin = heads
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    y = torch.empty((m, n), dtype=r.out, device=x.device)
    launcher(_qkv_kernel, r.grid, compile_only)(
        x,
        w,
        y,
        norm if norm is not None else w,
        qw,
        kw,
        cos_sin,
        workspace(r.workspace, y),
        counts if r.grid[1] > 1 else y,
        m,
        k,
        r.per,
        r.pre,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        cos_sin.stride(0),
        eps,
        head_eps,
        **r.meta,
    )
    return y


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    c: Config,
    counts: torch.Tensor | None,
    heads: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, int, int],
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: dict | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """[m, (hq + 2 hkv) * d]: the qkv projection of prologue(x) with its heads' epilogue.
    `heads`: (q norm weight, k norm weight, eps, cos_sin [m, 2, d] float32, hq, hkv).
    `compile_only`: compiled for these arguments, not run (the output is then unwritten)."""
    qw, kw, head_eps, cos_sin, hq, hkv = heads
    shape = (qw.shape[0], hq, hkv)
    r = recipe(x, w, c, counts is not None, shape, norm=norm is not None, pdl=pdl)
    spec = (qw, kw, head_eps, cos_sin)
    return go(r, x, w, counts, spec, norm=norm, eps=eps, compile_only=compile_only)
