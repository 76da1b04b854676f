"""Decode projections: y = x @ w.T for 1 to 64 rows, with the ops around them fused.

Program (column tile, split) streams BLOCK_N weight rows over its share of K once for all
rows of x (`operand`: the weight tile is the tensor cores' left operand; the loop is
pipelined for 16-bit inputs, `tuning`). The prologue is applied to the input tile as it is
loaded: RMSNorm (x * g, the row's sum of squares accumulated on the way; 1 / rms scales the
product at the end, so no pass over the row comes first) or SiLU(gate) * up. With a split,
each program stores its partial and the tile's last program sums them in split order
(`fixup`); then the epilogue: the norm's scale, the residual add, one rounding to the
output dtype.

The qkv projection with its per-head norm and rotary is `qkv.py`, over the same pieces.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from . import cdiv, dot_precision, dot_upcast, launcher, pdl_options, prefetch, tuning
from .fixup import arrive, gather, gather_row, publish, publish_row, slot
from .operand import accumulate, input_tile, weight_tile
from .tuning import Config, stages_for

# fmt: off
# Triton kernels take every pointer, stride and tile size as its own argument; one per line
# would bury each kernel under its signature (as in decode.py), so these keep them packed.

@triton.jit
def _finish(Y, R, rn, rm, n_ok, m_ok, acc, ss, K, eps, s_ym, s_rm,
            NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """The epilogue of a column tile: scale by 1 / rms, add the residual, store."""
    y = acc
    if NORM:
        y = y * (1.0 / tl.sqrt(ss / K + eps))[None, :]
    mask = n_ok[:, None] & m_ok[None, :]
    if RESIDUAL:
        y += tl.load(R + rm[None, :] * s_rm + rn[:, None], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rm[None, :] * s_ym + rn[:, None], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _step(acc, ss, w, X, G, rm, k, m_ok, K, s_xm, BLOCK_M: tl.constexpr, NORM: tl.constexpr,
          GATED: tl.constexpr, MMA: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr,
          PRECISION: tl.constexpr):
    """One K tile of the product: the input tile at k against weight tile w."""
    x, sq = input_tile(X, G, rm, k, m_ok, K, s_xm, BLOCK_M, NORM, GATED, EVEN)
    return accumulate(acc, w, x, MMA, UPCAST, PRECISION), ss + sq


@triton.jit
def product(X, W, G, rows, rm, n_ok, m_ok, k, K, k_per, s_xm, s_wn, ahead,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            NORM: tl.constexpr, GATED: tl.constexpr, MMA: tl.constexpr, EVEN: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, PRELOAD: tl.constexpr):
    """One program's share of the product: acc [BLOCK_N, BLOCK_M] over k_per columns of K
    from k (weight rows `rows`), and the input rows' sum of squares over them. PRELOAD: the
    first PRELOAD weight tiles are `ahead`'s, loaded before the program waited."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for i in tl.static_range(PRELOAD):
        acc, ss = _step(acc, ss, ahead[i], X, G, rm, k, m_ok, K, s_xm, BLOCK_M, NORM, GATED,
                        MMA, EVEN, UPCAST, PRECISION)
        k += BLOCK_K
    for _ in range(PRELOAD * BLOCK_K, k_per, BLOCK_K):
        w = weight_tile(W, rows, k, n_ok, K, s_wn, EVEN)
        acc, ss = _step(acc, ss, w, X, G, rm, k, m_ok, K, s_xm, BLOCK_M, NORM, GATED, MMA,
                        EVEN, UPCAST, PRECISION)
        k += BLOCK_K
    return acc, ss


@triton.jit
def _gemv_kernel(X, W, Y, R, G, Part, Count, M, N, K, k_per, k_pre, s_xm, s_wn, s_ym, s_rm,
                 eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                 RESIDUAL: tl.constexpr, MMA: tl.constexpr, EVEN: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr, LINE: tl.constexpr, TRIGGER: tl.constexpr,
                 PRELOAD: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    rows, k = rn.to(tl.int64), split * k_per + tl.arange(0, BLOCK_K)
    ahead = prefetch.tiles_ahead(W, rows, k, n_ok, K, s_wn, BLOCK_K, EVEN, PRELOAD)
    # nothing the previous kernel writes is read, nor anything written, before this
    prefetch.enter(W, rows, n_ok, split * k_per, k_pre, K, s_wn, BLOCK_K, LINE, PREFETCH, PDL,
                   TRIGGER)
    acc, ss = product(X, W, G, rows, rm, n_ok, m_ok, k, K, k_per, s_xm, s_wn, ahead,
                      BLOCK_M, BLOCK_N, BLOCK_K, NORM, GATED, MMA, EVEN, UPCAST, PRECISION,
                      PRELOAD)
    prefetch.leave(PDL, TRIGGER)
    if SPLIT == 1:
        _finish(Y, R, rn, rm, n_ok, m_ok, acc, ss, K, eps, s_ym, s_rm, NORM, RESIDUAL)
    else:
        at = slot(Part, tile, split, SPLIT, BLOCK_N + 1, BLOCK_M)
        publish(at, acc, 0, BLOCK_N, BLOCK_M)
        publish_row(at, ss, BLOCK_N, BLOCK_M)
        if arrive(Count, tile, SPLIT):
            acc = gather(Part, tile, 0, SPLIT, BLOCK_N + 1, BLOCK_N, BLOCK_M)
            ss = gather_row(Part, tile, BLOCK_N, SPLIT, BLOCK_N + 1, BLOCK_M)
            _finish(Y, R, rn, rm, n_ok, m_ok, acc, ss, K, eps, s_ym, s_rm, NORM, RESIDUAL)

# fmt: on


def k_share(k: int, c: Config) -> tuple[int, int]:
    """(K per split, a multiple of BLOCK_K; the number of splits that K needs)."""
    return tuning.k_share(k, c.split, c.block_k)


def partials(tiles: int, split: int, rows: int, c: Config) -> int:
    """Float32 partials of a split: one slot of `rows` x BLOCK_M per (tile, split); none
    without a split."""
    return 0 if split == 1 else tiles * split * rows * c.block_m


def workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    """The split's float32 partials (`partials`); without a split no slot is read, and
    `like` stands in."""
    if numel == 0:
        return like
    return torch.empty(numel, dtype=torch.float32, device=like.device)


class Recipe(NamedTuple):
    """What a projection launch derives from its shapes, dtypes, configuration and knobs
    alone, so a caller that meets the same kind of call again reuses it (`projection`)."""

    grid: tuple[int, int]  # (column tiles, K splits)
    per: int  # K columns a split walks
    pre: int  # the prefetch's columns (a positional argument)
    out: torch.dtype
    workspace: int  # float32 partials the split needs (0: unsplit)
    meta: dict[str, Any]  # the kernel's constexprs and launch options


def recipe(
    x: torch.Tensor,
    w: torch.Tensor,
    c: Config,
    split_ok: bool,
    *,
    norm: bool = False,
    gated: bool = False,
    residual: torch.dtype | None = None,
    pdl: dict | None = None,
) -> Recipe:
    """The launch of configuration `c` over x's rows (`split_ok`: the arena's counts are
    there, so K may be split), with a norm prologue or not, gated or not, a residual of
    that dtype or none, under `pdl` (PDL's options, default off)."""
    n, k = w.shape[0], w.shape[1]
    per, split = k_share(k, c if split_ok else c._replace(split=1))
    # the weights' dtype, or a float32 residual stream's (the sum is stored unrounded)
    out = w.dtype if residual is None else torch.promote_types(w.dtype, residual)
    tiles = cdiv(n, c.block_n)
    pre, options = shared_options(x, w, c, per, split, norm, pdl)
    meta = {"BLOCK_N": c.block_n, "GATED": gated, "RESIDUAL": residual is not None, **options}
    return Recipe((tiles, split), per, pre, out, partials(tiles, split, c.block_n + 1, c), meta)


def go(
    r: Recipe,
    x: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor | None,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """y [m, n] = epilogue(prologue(x) @ w.T) as `r` says (made for these arguments' kind).
    `compile_only`: compiled for these arguments, not run (`y` is then unwritten)."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    y = torch.empty((m, n), dtype=r.out, device=x.device)
    res = residual if residual is not None else y
    launcher(_gemv_kernel, r.grid, compile_only)(
        x,
        w,
        y,
        res,
        norm if norm is not None else w,
        workspace(r.workspace, y),
        counts if r.grid[1] > 1 else y,
        m,
        n,
        k,
        r.per,
        r.pre,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        res.stride(0),
        eps,
        **r.meta,
    )
    return y


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    c: Config,
    counts: torch.Tensor | None,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    pdl: dict | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """y [m, n] = epilogue(prologue(x) @ w.T) in w's dtype (a float32 residual's with one),
    with configuration `c` (its split needs `counts`, the arena; without it the launch is
    unsplit). `compile_only`: compiled for these arguments, not run (`y` is then unwritten)."""
    res_dtype = None if residual is None else residual.dtype
    r = recipe(
        x, w, c, counts is not None, norm=norm is not None, gated=gated, residual=res_dtype, pdl=pdl
    )
    return go(r, x, w, counts, norm=norm, eps=eps, residual=residual, compile_only=compile_only)


def shared_options(
    x: torch.Tensor,
    w: torch.Tensor,
    c: Config,
    per: int,
    split: int,
    norm: bool,
    pdl: dict | None,
) -> tuple[int, dict[str, Any]]:
    """What every projection kernel's launch takes alike: the prefetch's count (a positional
    argument) and the meta-parameters and launch options of configuration `c` over a K
    share of `per` in `split` parts, with a norm prologue or not, under `pdl` (PDL's
    options, default off)."""
    pdl = pdl or pdl_options()
    pre, pre_opts = prefetch.options(w, per, c.block_k, pdl["PDL"])
    k = w.shape[1]
    return pre, {
        "BLOCK_M": c.block_m,
        "BLOCK_K": c.block_k,
        "SPLIT": split,
        "NORM": norm,
        "MMA": c.mma,
        "EVEN": k % c.block_k == 0 and per * split == k,
        "UPCAST": dot_upcast(),
        "PRECISION": dot_precision(w.dtype),
        "num_warps": c.warps,
        "num_stages": stages_for(c, x.dtype, w.dtype),
        **pre_opts,
        **pdl,
    }
