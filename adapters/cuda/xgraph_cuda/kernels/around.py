"""The ops fused around a projection, as kernels of their own around a cuBLAS product.

Past a few dozen rows the decode projection kernels (`gemv`, `qkv`) lose to cuBLAS: they
stream the weights well, but their programs reload the input rows for every column tile
and recompute its prologue there (docs/kernels.md, "Rows for cuBLAS"). For those rows
`projection` runs the fusion as three launches instead of one: the prologue here (RMSNorm,
or SiLU(gate) * up, computed in float32 and rounded once to the weights' dtype), the
product on cuBLAS, then the epilogue: the residual add (`residual`: the 16-bit product
summed into the float32 stream), or the per-head norm and rotary of a qkv product (`heads`:
the qkv kernel's own epilogue, run in place over the product). The arithmetic is the
reference ops' order (the norm's scale before the product, the epilogue over the rounded
product), not the decode kernels' (the scale and the epilogue over the float32
accumulator), so the two agree within 16-bit rounding, not bit for bit.

Every launch here goes without PDL's attribute: each keeps a full edge to its predecessor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from xgraph.adapter import Fusion, HeadNorm

from . import cdiv, launcher
from .qkv import _head_epilogue

GATE_BLOCK = 1024  # columns per program of SiLU(gate) * up and of the residual add
HEAD_ROWS = 16  # tokens per program of the heads' epilogue

# fmt: off
# Triton kernels take every pointer, stride and tile size as its own argument; one per line
# would bury each kernel under its signature (as in decode.py), so these keep them packed.

@triton.jit
def _norm_kernel(X, G, Y, K, s_xm, s_ym, eps, BLOCK: tl.constexpr):
    """Row `program_id` of x / rms(x) * g, the whole row in one tile."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < K
    x = tl.load(X + row * s_xm + c, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + c, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / K + eps)
    tl.store(Y + row * s_ym + c, (x * g * r).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _gate_kernel(X, Y, K, s_xm, s_ym, BLOCK: tl.constexpr):
    """Columns of one row of SiLU(gate) * up, X holding [gate | up] of K columns each."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < K
    gate = tl.load(X + row * s_xm + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * s_xm + K + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * s_ym + c, (gate / (1.0 + tl.exp(-gate)) * up).to(Y.dtype.element_ty),
             mask=ok)


@triton.jit
def _residual_kernel(Y, R, Out, N, s_ym, s_rm, s_om, BLOCK: tl.constexpr):
    """Columns of one row of y + r, summed in float32 and rounded once to Out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < N
    y = tl.load(Y + row * s_ym + c, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + row * s_rm + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * s_om + c, (y + r).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _heads_kernel(Y, QW, KW, CS, M, s_ym, s_cs, head_eps,
                  HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """A q or k head of BLOCK_M tokens normed and rotated in place (v heads are left). The
    block's first row offsets Y and CS in 64 bits: the epilogue's own row offsets are 32-bit
    (decode's rows are few), and a prefill's rows times the row stride need not be."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_M
    head = tl.program_id(1)
    Y += first * s_ym
    CS += first * s_cs
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M - first
    c = tl.arange(0, HALF)
    at = Y + rm[None, :] * s_ym + head * (2 * HALF) + c[:, None]
    lo = tl.load(at, mask=m_ok[None, :], other=0.0).to(tl.float32)
    hi = tl.load(at + HALF, mask=m_ok[None, :], other=0.0).to(tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    _head_epilogue(Y, QW, KW, CS, head, rm, m_ok, lo, hi, ss, 1, 0.0, head_eps, s_ym, s_cs,
                   HQ, HKV, HALF, False)

# fmt: on


def run(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> torch.Tensor:
    """epilogue(prologue(x) @ w.T): the prologue's kernel, cuBLAS, the epilogue's kernel;
    in w's dtype, or a float32 residual's with one (what `gemv.launch` returns)."""
    a = x
    if f.norm is not None:
        a = norm(x, f.norm, f.eps, w.dtype)
    elif f.gated:
        a = gate(x)
    y = F.linear(a, w)
    if f.residual is not None:
        return residual(y, f.residual)
    return y if f.heads is None else heads(y, f.heads)


def compile_kernels(x: torch.Tensor, w: torch.Tensor, f: Fusion) -> None:
    """The prologue's and epilogue's kernels of this call compiled, not run."""
    if f.norm is not None:
        norm(x, f.norm, f.eps, w.dtype, compile_only=True)
    elif f.gated:
        gate(x, compile_only=True)
    if f.residual is None and f.heads is None:
        return
    y = torch.empty((x.shape[0], w.shape[0]), dtype=w.dtype, device=x.device)
    if f.residual is not None:
        residual(y, f.residual, compile_only=True)
    else:
        heads(y, f.heads, compile_only=True)


def norm(
    x: torch.Tensor, g: torch.Tensor, eps: float, dtype: torch.dtype, compile_only: bool = False
) -> torch.Tensor:
    """rms_norm(x) * g in `dtype` (x may be the float32 residual stream)."""
    m, k = x.shape
    y = torch.empty((m, k), dtype=dtype, device=x.device)
    block = triton.next_power_of_2(k)
    launcher(_norm_kernel, (m,), compile_only)(
        x, g, y, k, x.stride(0), y.stride(0), eps, BLOCK=block, num_warps=_warps(block)
    )
    return y


def gate(x: torch.Tensor, compile_only: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of x [m, 2k], in x's dtype."""
    m, k = x.shape[0], x.shape[1] // 2
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    grid = (m, cdiv(k, GATE_BLOCK))
    launcher(_gate_kernel, grid, compile_only)(
        x, y, k, x.stride(0), y.stride(0), BLOCK=GATE_BLOCK, num_warps=4
    )
    return y


def residual(y: torch.Tensor, r: torch.Tensor, compile_only: bool = False) -> torch.Tensor:
    """y + r in their promoted dtype (the float32 stream's with one): torch's add of a 16-bit
    and a float32 tensor is not vectorized, 3.4 us a call at [64, 1024] on an H100."""
    m, n = y.shape
    out = torch.empty((m, n), dtype=torch.promote_types(y.dtype, r.dtype), device=y.device)
    grid = (m, cdiv(n, GATE_BLOCK))
    launcher(_residual_kernel, grid, compile_only)(
        y, r, out, n, y.stride(0), r.stride(0), out.stride(0), BLOCK=GATE_BLOCK, num_warps=4
    )
    return out


def heads(y: torch.Tensor, h: HeadNorm, compile_only: bool = False) -> torch.Tensor:
    """The qkv product y [m, (heads + 2 kv_heads) * head_dim] with its q and k heads normed
    and rotated by `h`, in place."""
    m = y.shape[0]
    grid = (cdiv(m, HEAD_ROWS), h.heads + h.kv_heads)  # rows on x: y stops at 65,535
    launcher(_heads_kernel, grid, compile_only)(
        y,
        h.q_weight,
        h.k_weight,
        h.cos_sin,
        m,
        y.stride(0),
        h.cos_sin.stride(0),
        h.eps,
        HQ=h.heads,
        HKV=h.kv_heads,
        HALF=h.head_dim // 2,
        BLOCK_M=HEAD_ROWS,
        num_warps=4,
    )
    return y


def _warps(block: int) -> int:
    """Warps for a row of `block` columns: about eight columns a thread, 1 to 16 warps."""
    return max(1, min(16, block // 256))
