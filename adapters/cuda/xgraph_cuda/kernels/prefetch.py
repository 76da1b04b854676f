"""A projection's entry: its weights asked of L2, then the wait for its predecessor.

A decode projection's weights never depend on the kernel before it, only its input rows do.
So each program first asks L2 for (a prefix of) its own weight slice, one `prefetch.global.L2`
per 128-byte line, and only then waits (`gdc_wait` under PDL). Launched programmatically, a
projection's programs start while the previous kernel still runs, and its weight stream
overlaps that kernel's tail instead of following it; launched plainly, the whole slice is in
flight from the program's first instruction instead of `num_stages` tiles. A prefetch is a
hint: it writes nothing and changes no result (the race check compares with and without).

How much to ask for: the whole slice where the projection's weights fit in a third of L2;
else the same share of every program's slice (the programs then read the rest as before),
so what is asked for is still in L2 when the loop reaches it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from xgraph.adapter import XGraphError

from . import interpreting
from .operand import weight_tile

LINE_BYTES = 128  # one L2 request per cache line
_MODES = ("on", "off")


@triton.jit
def _ask(ptr):
    """One L2 prefetch per pointer (a hint: nothing is written, no register is kept)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def weight_slice(W, rows, n_ok, k0, k_len, K, s_wn, BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for weight rows `rows` (int64), columns k0 .. k0 + k_len (LINE elements a
    request); rows past the matrix and columns past K ask for W's first line instead."""
    c = tl.arange(0, BLOCK_K // LINE) * LINE
    for kk in range(0, k_len, BLOCK_K):
        k = k0 + kk + c
        ok = n_ok[:, None] & (k < K)[None, :]
        _ask(tl.where(ok, W + rows[:, None] * s_wn + k[None, :], W))


@triton.jit
def tile_ahead(W, rows, k, n_ok, K, s_wn, EVEN: tl.constexpr, PRELOAD: tl.constexpr):
    """With PRELOAD, the weight tile at columns k, loaded into registers before the program
    waits (weights are never written in a step); without, a placeholder (the loop loads it)."""
    if PRELOAD:
        w = weight_tile(W, rows, k, n_ok, K, s_wn, EVEN)
    else:
        w = tl.zeros([1], tl.float32)
    return w


@triton.jit
def tiles_ahead(
    W, rows, k, n_ok, K, s_wn, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PRELOAD: tl.constexpr
):
    """The program's first PRELOAD weight tiles from columns k, a tuple of PRELOAD_TILES
    (placeholders past PRELOAD)."""
    return (
        tile_ahead(W, rows, k, n_ok, K, s_wn, EVEN, PRELOAD >= 1),
        tile_ahead(W, rows, k + BLOCK_K, n_ok, K, s_wn, EVEN, PRELOAD >= 2),
        tile_ahead(W, rows, k + 2 * BLOCK_K, n_ok, K, s_wn, EVEN, PRELOAD >= 3),
        tile_ahead(W, rows, k + 3 * BLOCK_K, n_ok, K, s_wn, EVEN, PRELOAD >= 4),
    )


@triton.jit
def enter(
    W,
    rows,
    n_ok,
    k0,
    k_pre,
    K,
    s_wn,
    BLOCK_K: tl.constexpr,
    LINE: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """A projection program's first instructions: its weight prefix asked of L2 (nothing the
    previous kernel writes), then, under PDL, the wait for the previous kernel and the
    release of the next one: after the wait (TRIGGER 0), before it (1: the next kernel's
    programs may then start their own prefetch while this one waits), or not here (2: at
    the end of the program's product, `leave`)."""
    if PREFETCH:
        weight_slice(W, rows, n_ok, k0, k_pre, K, s_wn, BLOCK_K, LINE)
    if PDL:
        if TRIGGER == 1:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if TRIGGER == 0:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def leave(PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """With TRIGGER 2, the release of the next kernel once this program's weights are read:
    its programs then take the SMs as this kernel's last ones drain, not while its middle
    waves still need them."""
    if PDL and TRIGGER == 2:
        tl.extra.cuda.gdc_launch_dependents()


def mode() -> str:
    """XGRAPH_CUDA_PREFETCH: on, off (the default until a device run shows the gain)."""
    v = os.environ.get("XGRAPH_CUDA_PREFETCH", "off").strip().lower()
    return v if v in _MODES else "off"


@functools.cache
def l2_bytes(device: torch.device) -> int:
    """The device's L2 size (a small fixed size off the GPU)."""
    if device.type != "cuda":
        return 4 << 20
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def share(total: int, per: int, block_k: int, budget: int) -> int:
    """Columns of a K share of `per` each program asks for, for a matrix of `total` bytes
    and an L2 budget: all of it where the matrix fits, else the matching fraction in whole K
    tiles, at least one."""
    if total <= budget:
        return per
    return max(block_k, (per * budget // total) // block_k * block_k)


def columns(w: torch.Tensor, per: int, block_k: int) -> int:
    """Columns of its K share each program of a projection over `w` asks L2 for before it
    waits: a third of L2 is the budget (0 in the interpreter, off the GPU or when off)."""
    if interpreting() or not w.is_cuda or mode() != "on":
        return 0
    return share(w.numel() * w.element_size(), per, block_k, l2_bytes(w.device) // 3)


TRIGGERS = {"late": 0, "early": 1, "end": 2}


def trigger() -> int:
    """XGRAPH_CUDA_PDL_TRIGGER: where a projection releases its successor under PDL, `late`
    (the default: after its wait), `early` (before it) or `end` (after its product)."""
    return TRIGGERS.get(os.environ.get("XGRAPH_CUDA_PDL_TRIGGER", "late").strip().lower(), 0)


PRELOAD_TILES = 4  # the most weight tiles a program loads before it waits (`tiles_ahead`'s)
# `auto` loads two where a program walks at most this many K tiles (all or half its slice);
# measured on an H100 (docs/kernels.md): Qwen3-0.6B's projections (2-4 tiles a program) 5%
# and 8% faster at batch 1 and 8, Qwen3-8B's long loops (16-48 tiles) 14% slower with two
SHORT_SLICE_TILES, SHORT_SLICE_AHEAD = 4, 2


def preload() -> int | None:
    """XGRAPH_CUDA_PRELOAD: weight tiles a projection program loads before its PDL wait:
    `auto` (the default, None here: `ahead` decides per launch), `on` (its first tile),
    `off` (none) or a count from 0 to PRELOAD_TILES; anything else is refused."""
    return _preload(os.environ.get("XGRAPH_CUDA_PRELOAD", "auto").strip().lower())


@functools.lru_cache(maxsize=8)  # read at every projection launch: parse each value once
def _preload(v: str) -> int | None:
    named = {"auto": None, "on": 1, "off": 0}
    if v in named:
        return named[v]
    if v.isascii() and v.isdigit() and int(v) <= PRELOAD_TILES:
        return int(v)
    raise XGraphError(
        f"XGRAPH_CUDA_PRELOAD={v!r}; give auto (the default), on, off or a count of weight "
        f"tiles from 0 to {PRELOAD_TILES} (docs/kernels.md, 'The first weight tiles before the "
        "wait')."
    )


def ahead(tiles: int) -> int:
    """Weight tiles loaded before the wait by a program that walks `tiles` K tiles: as asked
    (`preload`), else two for a short slice and one otherwise; never more than it walks."""
    asked = preload()
    if asked is None:
        asked = SHORT_SLICE_AHEAD if tiles <= SHORT_SLICE_TILES else 1
    return min(asked, tiles)


def options(w: torch.Tensor, per: int, block_k: int, waits: bool) -> tuple[int, dict]:
    """(columns each program asks L2 for, the launch's PREFETCH, LINE, TRIGGER and PRELOAD
    constexprs). `waits`: the kernel waits for its predecessor (PDL compiled in); only then
    are tiles loaded ahead (without a wait it would only reorder the loop, which was not
    measured), and never more than the `per` columns a program walks."""
    cols = columns(w, per, block_k)
    line = min(block_k, max(1, LINE_BYTES // w.element_size()))
    tiles = ahead(per // block_k) if waits else 0
    # the release point only where there is a wait (without one the kernel never reads it)
    release = trigger() if waits else 0
    return cols, {"PREFETCH": cols > 0, "LINE": line, "TRIGGER": release, "PRELOAD": tiles}
