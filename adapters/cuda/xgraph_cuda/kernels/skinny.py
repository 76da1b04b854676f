"""Skinny linear: y = x @ w.T for a few rows of x (decode), streaming w at full width.

With one to a few rows, a projection is a read of its weight matrix and nothing else; the
kernel's cost is how many bytes are in flight. cuBLAS picks tiles for some of these shapes
that leave most of the GPU idle (the reference model's o_proj at batch 1 reads 4 MiB in
12.5 us on an H200, 0.3 TB/s). Here every program owns `BLOCK_N` output columns and walks
the whole K for all rows at once, so the grid is N / BLOCK_N programs, enough to cover the
SMs for every projection of the reference shapes; products and sums are float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import cdiv

MAX_ROWS = 4  # above this cuBLAS's tensor-core tiles win
NARROW = 2048  # from 2 rows on, only outputs this narrow gain (cuBLAS idles SMs on them)


@triton.jit
def _skinny_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    s_xm,
    s_wn,
    s_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptr = W + rn.to(tl.int64)[:, None] * s_wn + rk[None, :]
    x_ptr = X + rm[:, None] * s_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptr, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + rk) < K
            w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, axis=2)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    y = Y + rm[:, None] * s_ym + rn[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class Config(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int


def pick(m: int, n: int, k: int) -> Config:
    """Tiles for an [m, k] x [n, k]^T product, from a sweep on an H200 over the reference
    shapes (adapters/cuda/tools/probe_skinny_linear.py): two columns a program below 4096
    outputs (two or more programs per SM), eight above; K in steps of up to 1024, a product
    tile (rows x columns x k) of at most 16384 float32 values; four warps, four pipeline
    stages."""
    block_m = triton.next_power_of_2(m)
    block_n = 8 if n >= 4096 else 2
    block_k = max(64, min(1024, 16384 // (block_m * block_n), triton.next_power_of_2(k)))
    return Config(block_n, block_k, 4, 4)


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel beats cuBLAS on this call, and can take it: one row, or up to
    MAX_ROWS rows into a narrow output; 2-d, unit inner strides, one float dtype."""
    m = x.shape[0] if x.dim() == 2 else 0
    return (
        (m == 1 or (0 < m <= MAX_ROWS and w.shape[0] <= NARROW))
        and w.dim() == 2
        and x.shape[1] == w.shape[1]
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.stride(1) == 1
        and w.stride(1) == 1
        and x.device == w.device
    )


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """`Backend.linear_kernel`: x @ w.T where `serves` says so, else None (F.linear runs)."""
    return skinny_linear(x, w) if serves(x, w) else None


def skinny_linear(x: torch.Tensor, w: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """x [m, k] @ w[n, k].T -> [m, n] in x's dtype, for any m (the tiles hold all m rows:
    past MAX_ROWS it is slow, not wrong); strides as `serves` asks."""
    m, k = x.shape
    n = w.shape[0]
    c = config or pick(m, n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_kernel[(cdiv(n, c.block_n),)](
        x,
        w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        EVEN_K=k % c.block_k == 0,
        num_warps=c.warps,
        num_stages=c.stages,
    )
    return y
