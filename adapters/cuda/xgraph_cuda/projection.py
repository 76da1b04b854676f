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
their successor start early. Importing this module loads no Triton (its kernels do).
"""

from __future__ import annotations

import torch

from xgraph.adapter import Fusion, HeadNorm

from . import family, pdl
from .kernels import arena, interpreting, sm_count
from .kernels.tuning import Config, pick
from .rows import cublas_rows

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (32, 64, 128, 256)  # half a head must fill the tensor cores' 16 rows


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
    from .kernels import gemv, qkv  # Triton: imported where it is known to be there

    counts = arena.counts(x.device)
    on = pdl.launch_options(x.is_cuda, w.numel() * w.element_size())
    h = f.heads
    if h is not None:
        spec = (h.q_weight, h.k_weight, h.eps, h.cos_sin, h.heads, h.kv_heads)
        return qkv.launch(
            x, w, c, counts, spec, norm=f.norm, eps=f.eps, pdl=on, compile_only=compile_only
        )
    return gemv.launch(
        x,
        w,
        c,
        counts,
        norm=f.norm,
        eps=f.eps,
        gated=f.gated,
        residual=f.residual,
        pdl=on,
        compile_only=compile_only,
    )


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
    if x.is_cuda:
        family.compile_family(x, w, f, _compile_one)
    return run(x, w, f, config(x, w, f))


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
