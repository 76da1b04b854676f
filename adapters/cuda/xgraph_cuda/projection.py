"""The CUDA adapter's projection kernels as the core's duties: `plain` for `xgraph.linear`,
`fused` for `linear(x, w, fusion)` (`Kernels.linear`, `Kernels.fused_linear`).

Both serve 16- or 32-bit float inputs with unit inner strides, on CUDA tensors (or CPU
tensors in Triton's interpreter), and answer None for anything else (F.linear, or the
fusion's reference ops, run those). Decode's rows up to `rows.cublas_rows` go to the
decode kernels (at most `kernels.tuning.MAX_ROWS`); from there `fused` runs cuBLAS with the
fusion's ops as kernels of their own (`kernels.around`) and `plain` answers None. A call
that needs a split K and finds no arrival counts (the first call of a process made inside a
capture, `kernels.arena`) runs unsplit. Launches made while a capture asked for
programmatic dependent launch (`pdl`) wait for their predecessor in the kernel and let
their successor start early. What a launch derives from the call's kind (its
configuration, split, prefetch, PDL options and constexprs: a `kernels.gemv.Recipe`) is
made at the first call of each kind and row count and kept, keyed with the environment's
knobs it reads (`KNOBS`): a decode forward makes about 110 such calls, and deriving it
anew took a quarter to a third of a call's host time on an H100 host. Importing this module
loads no Triton (its kernels do).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from xgraph.adapter import Fusion, HeadNorm

from . import family, pdl
from .kernels import arena, interpreting, sm_count
from .kernels.tuning import Config, pick
from .rows import cublas_rows

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (32, 64, 128, 256)  # half a head must fill the tensor cores' 16 rows
# the environment a recipe reads (`kernels.prefetch`, `pdl.max_bytes`), all but the first
# only under PDL: tests hold a recipe's reads to these
KNOBS = (
    "XGRAPH_CUDA_PREFETCH",
    "XGRAPH_CUDA_PDL_TRIGGER",
    "XGRAPH_CUDA_PRELOAD",
    "XGRAPH_CUDA_PDL_MAX_MIB",
)
MAX_RECIPES = 4096
_recipes: dict[tuple, Any] = {}


def _on_device(*ts: torch.Tensor) -> bool:
    return interpreting() or all(t.is_cuda for t in ts)


def _pair_fits(x: torch.Tensor, w: torch.Tensor, width: int, stream: bool) -> bool:
    """x [m, width] and w [n, k] that the kernels take: few rows, one float dtype (or, with
    `stream`, a float32 x over 16-bit weights: a norm prologue reading the residual stream),
    unit inner strides, one device."""
    return (
        x.dim() == 2
        and w.dim() == 2
        and x.shape[0] > 0
        and x.shape[1] == width
        and w.dtype in DTYPES
        and (x.dtype == w.dtype or (stream and x.dtype == torch.float32))
        and x.stride(1) == 1
        and w.stride(1) == 1
        and x.device == w.device
        and _on_device(x, w)
    )


def _heads_fit(h: HeadNorm, m: int, n: int) -> bool:
    d = h.head_dim
    cs = h.cos_sin
    return (
        d in HEAD_DIMS
        and n == (h.heads + 2 * h.kv_heads) * d
        and h.q_weight.shape == (d,) == h.k_weight.shape
        and h.q_weight.is_contiguous()
        and h.k_weight.is_contiguous()
        and cs.dtype == torch.float32
        and cs.dim() == 3
        and cs.shape[0] >= m
        and tuple(cs.shape[1:]) == (2, d)
        and cs.stride(2) == 1
        and cs.stride(1) == d
    )


def serves(x: torch.Tensor, w: torch.Tensor, f: Fusion | None = None) -> bool:
    """Whether the kernels take this call (with its fusion)."""
    f = f or Fusion()
    k = w.shape[-1]
    if not _pair_fits(x, w, 2 * k if f.gated else k, f.norm is not None):
        return False
    m, n = x.shape[0], w.shape[0]
    if f.norm is not None and (f.norm.shape != (k,) or not f.norm.is_contiguous()):
        return False
    r = f.residual
    # the residual is the stream: the weights' dtype, or float32 (the sum is stored in it)
    stream = (w.dtype, torch.float32)
    if r is not None and (r.shape != (m, n) or r.dtype not in stream or r.stride(1) != 1):
        return False
    return f.heads is None or _heads_fit(f.heads, m, n)


def config(x: torch.Tensor, w: torch.Tensor, f: Fusion | None = None) -> Config:
    """The default launch configuration of this call (`kernels.tuning.pick`)."""
    head_dim = f.heads.head_dim if f is not None and f.heads is not None else None
    return pick(x.shape[0], w.shape[0], w.shape[1], sm_count(x.device), head_dim)


def run(
    x: torch.Tensor, w: torch.Tensor, f: Fusion, c: Config, compile_only: bool = False
) -> torch.Tensor:
    """The call with configuration `c` (it must be served: `serves`); `compile_only`: its
    kernel compiled, not run."""
    counts = arena.counts(x.device)
    return _go(_recipe(x, w, f, c, counts is not None), x, w, f, counts, compile_only)


def _recipe(x: torch.Tensor, w: torch.Tensor, f: Fusion, c: Config, split_ok: bool) -> Any:
    """The launch's recipe (`kernels.gemv.Recipe`) of configuration `c` for this call."""
    from .kernels import gemv, qkv  # Triton: imported where it is known to be there

    on = pdl.launch_options(x.is_cuda, w.numel() * w.element_size())
    h = f.heads
    if h is not None:
        shape = (h.head_dim, h.heads, h.kv_heads)
        return qkv.recipe(x, w, c, split_ok, shape, norm=f.norm is not None, pdl=on)
    res = None if f.residual is None else f.residual.dtype
    norm = f.norm is not None
    return gemv.recipe(x, w, c, split_ok, norm=norm, gated=f.gated, residual=res, pdl=on)


def _go(
    r: Any,
    x: torch.Tensor,
    w: torch.Tensor,
    f: Fusion,
    counts: torch.Tensor | None,
    compile_only: bool = False,
) -> torch.Tensor:
    """The call launched as recipe `r` says."""
    from .kernels import gemv, qkv

    h = f.heads
    if h is not None:
        spec = (h.q_weight, h.k_weight, h.eps, h.cos_sin)
        return qkv.go(r, x, w, counts, spec, norm=f.norm, eps=f.eps, compile_only=compile_only)
    return gemv.go(
        r, x, w, counts, norm=f.norm, eps=f.eps, residual=f.residual, compile_only=compile_only
    )


def knobs(waits: bool) -> tuple[str | None, ...]:
    """The environment's values that a recipe reads (`KNOBS`; with no PDL wait compiled in,
    `waits` False, only the first), as given: part of its key, so a knob changed between
    calls takes effect at the next one."""
    return tuple(map(os.environ.get, KNOBS if waits else KNOBS[:1]))


def forget() -> None:
    """Drop every kept recipe: for code that changes how recipes are made (the
    configuration's `pick`, the stages), not for knobs (they are in the key)."""
    _recipes.clear()


def _kept_recipe(
    x: torch.Tensor, w: torch.Tensor, f: Fusion, kind: tuple, counts: torch.Tensor | None
) -> Any:
    """The default configuration's recipe of a call of this kind and row count, made at the
    first such call and kept (the kind holds every shape, dtype, device and PDL state the
    recipe reads; `knobs` the environment's part)."""
    key = (kind, x.shape[0], counts is not None, knobs(pdl.enabled() or pdl.waits()))
    r = _recipes.get(key)
    if r is None:
        if len(_recipes) >= MAX_RECIPES:  # a bound, never met by a model's calls
            _recipes.clear()
        r = _recipes[key] = _recipe(x, w, f, config(x, w, f), counts is not None)
    return r


def _on_cublas(x: torch.Tensor) -> bool:
    return x.shape[0] >= cublas_rows()  # at most 65 (rows.py): past 64 rows, always


def _compile_one(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> None:
    if _on_cublas(x):
        from .kernels import around

        around.compile_kernels(x, w, f)
    else:
        run(x, w, f, config(x, w, f), compile_only=True)


def _default(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor:
    """The call with its default configuration, its kind's binaries for every row count
    compiled first on the GPU (`family`); from `cublas_rows` rows, cuBLAS with the
    fusion's ops around it (`kernels.around`)."""
    if _on_cublas(x):
        from .kernels import around

        return around.run(x, w, f)
    kind = family.kind(x, w, f)
    if x.is_cuda:
        family.compile_family(x, w, f, _compile_one, kind)
    counts = arena.counts(x.device)
    return _go(_kept_recipe(x, w, f, kind, counts), x, w, f, counts)


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """`Kernels.linear`: x @ w.T for the calls served, else None (cuBLAS's rows too)."""
    if _on_cublas(x) or not serves(x, w):
        return None
    return _default(x, w, Fusion())


def fused(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor | None:
    """`Kernels.fused_linear`: the projection with its fusion for the calls served, else None."""
    if not serves(x, w, f):
        return None
    return _default(x, w, f)
