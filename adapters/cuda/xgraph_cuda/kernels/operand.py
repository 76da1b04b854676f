"""What the projection kernels share inside their K loop: the input tile after its prologue,
and one step of the product, on the tensor cores or as float32 multiply-adds.

The weight tile is the left operand ([columns, k]) and the input rows the right one, so a
tile of 16 to 128 output columns fills the matrix units' M dimension however few rows there
are ("swap AB"): with one row, 15 of the 16 columns of the instruction are padding, which
costs nothing in a product bound by the weight stream, and the weight loads feed the dot
directly.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def input_tile(
    X,
    G,
    rm,
    k,
    m_ok,
    K,
    s_xm,
    BLOCK_M: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Rows rm, columns k of the projection's input after its prologue (float32), and the
    tile's sum of squares per row (the RMSNorm's, of the raw input; zeros without NORM).

    NORM: x * g (the norm weight); the row's 1 / rms is a scalar of the whole row, applied
    to the product by the epilogue once the row's squares are summed. GATED: X holds [gate |
    up] of K columns each, and the input is silu(gate) * up."""
    if EVEN:
        mask = m_ok[:, None]
    else:
        mask = m_ok[:, None] & (k < K)[None, :]
    ptr = X + rm[:, None] * s_xm + k[None, :]
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(ptr + K, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    ss = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        ss = tl.sum(x * x, 1)
        if EVEN:
            g = tl.load(G + k)
        else:
            g = tl.load(G + k, mask=k < K, other=0.0)
        x = x * g.to(tl.float32)[None, :]
    return x, ss


@triton.jit
def accumulate(acc, w, x, MMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc [columns, rows] + w [columns, k] @ x [rows, k].T, the input rounded to the
    weights' dtype first (the operand an unfused model hands its GEMM). UPCAST: float32
    operands (the interpreter's 16-bit dot is wrong)."""
    xq = x.to(w.dtype)
    if MMA:
        if UPCAST:
            return acc + tl.dot(w.to(tl.float32), tl.trans(xq.to(tl.float32)))
        return tl.dot(w, tl.trans(xq), acc, input_precision=PRECISION)
    return acc + tl.sum(w.to(tl.float32)[:, None, :] * xq.to(tl.float32)[None, :, :], 2)


@triton.jit
def weight_tile(W, rows, k, n_ok, K, s_wn, EVEN: tl.constexpr):
    """Weight rows `rows` (int64), columns k: a [rows, k] tile, k contiguous (16-byte loads)."""
    ptr = W + rows[:, None] * s_wn + k[None, :]
    if EVEN:
        return tl.load(ptr, mask=n_ok[:, None], other=0.0)
    return tl.load(ptr, mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
