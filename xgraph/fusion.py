"""What a backend may fuse around a projection, and the reference math of each piece.

A decode layer spends its time in projections and in the small ops between them: the
RMSNorm before the qkv and gate/up projections, SiLU(gate) * up before down_proj, the
residual adds after o_proj and down_proj, and the per-head QK-norm and rotary embedding
after the qkv projection. `Fusion` names the pieces around one projection (a prologue on its
input, an epilogue on its output); `xgraph.linear.linear(x, w, fusion)` hands the whole to
the backend's fused kernel (`Kernels.fused_linear`) and runs `reference` where there is
none or it declines. `reference` is the unfused ops, each exactly as the reference model
wrote it before fusion (`rms_norm`, `silu_mul`, `apply_rotary`, a plain add), so a model
written over fusions computes on the CPU backend bit for bit what it computed unfused.

Where a backend has fused kernels, a model keeps its residual stream in float32
(`xgraph.linear.stream_dtype`): the residual epilogue adds the product to the float32
stream and stores it unrounded, and the next norm prologue reads it so, rounding only its
output to the weights' dtype. Every 16-bit rounding of the stream moves a bf16 model away
from float32; torch.compile drops many such casts inside its fused regions, and the float32
stream drops all of the stream's (docs/kernels.md, "The residual stream in float32").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import InputError


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, computed in float32, returned in `dtype`
    (default x's: a float32 residual stream is normed into the weights' dtype).

    A 1-d weight goes into F.rms_norm (one fused kernel on CUDA eager); a per-head weight
    [heads, dim] multiplies its result, the same product in the same order.
    """
    xf, out = x.float(), dtype or x.dtype
    if weight is not None and weight.dim() == 1:
        return F.rms_norm(xf, (x.shape[-1],), weight.float(), eps).to(out)
    y = F.rms_norm(xf, (x.shape[-1],), None, eps)
    return (y if weight is None else y * weight.float()).to(out)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dim times the second half (SwiGLU's gate * up)."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, dim] by its tokens' rows of a neox table: cos_sin [tokens,
    2, dim] holds [cos, cos] and [-sin, sin], so rotating is x * cos + roll(x, dim / 2) *
    sin, the same products and sums as the half-split form."""
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)


@dataclass(frozen=True)
class HeadNorm:
    """The epilogue of a merged qkv projection whose output is [tokens, heads + 2 *
    kv_heads, head_dim]: its first `heads` (q) and next `kv_heads` (k) heads are each
    RMS-normed with `q_weight` / `k_weight` [head_dim] and rotated by `cos_sin` [tokens, 2,
    head_dim] (float32, see apply_rotary); the v heads pass through."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    cos_sin: torch.Tensor
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return int(self.q_weight.shape[-1])


@dataclass(frozen=True)
class Fusion:
    """The ops fused around one projection y = x' @ w.T.

    Prologue (at most one): `norm` [k], x' = rms_norm(x, norm, eps) in w's dtype (x may be
    a float32 residual stream over 16-bit weights); or `gated`, x' = silu_mul(x) (x is
    [rows, 2k]). Epilogue (at most one): `residual` [rows, n], y + residual, in the promoted
    dtype (a float32 residual keeps the stream in float32); or `heads`, the per-head norm
    and rotary of a merged qkv output.
    """

    norm: torch.Tensor | None = None
    eps: float = 1e-6
    gated: bool = False
    residual: torch.Tensor | None = None
    heads: HeadNorm | None = None

    def __post_init__(self) -> None:
        if self.norm is not None and self.gated:
            raise InputError(
                "Fusion: norm and gated are both prologues of the projection's input; give "
                "one of them (normalise before the gate/up projection, gate before down_proj)."
            )
        if self.residual is not None and self.heads is not None:
            raise InputError(
                "Fusion: residual and heads are both epilogues; a merged qkv projection "
                "(heads) has no residual add. Give one of them."
            )

    @property
    def empty(self) -> bool:
        return self.norm is None and not self.gated and self.residual is None and not self.heads


Projection = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def prologue(x: torch.Tensor, f: Fusion, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The projection's input after the fusion's prologue; a norm's output in `dtype` (the
    weights'; default x's)."""
    if f.norm is not None:
        return rms_norm(x, f.norm, f.eps, dtype)
    return silu_mul(x) if f.gated else x


def epilogue(y: torch.Tensor, f: Fusion) -> torch.Tensor:
    """The projection's output after the fusion's epilogue."""
    if f.residual is not None:
        return y + f.residual
    h = f.heads
    if h is None:
        return y
    t, d, qk = y.shape[0], h.head_dim, h.heads + h.kv_heads
    heads = y.view(t, -1, d)
    w = torch.cat([h.q_weight.expand(h.heads, d), h.k_weight.expand(h.kv_heads, d)])
    normed = apply_rotary(rms_norm(heads[:, :qk], w, h.eps), h.cos_sin)
    return torch.cat([normed, heads[:, qk:]], 1).view(t, -1)


def reference(x: torch.Tensor, w: torch.Tensor, f: Fusion, project: Projection) -> torch.Tensor:
    """The fusion computed unfused: prologue, `project` (x @ w.T), epilogue."""
    return epilogue(project(prologue(x, f, w.dtype), w), f)


def output_dtype(w: torch.Tensor, f: Fusion) -> torch.dtype:
    """The dtype of `reference(x, w, f, ...)`: the weights', promoted with a residual's."""
    r = f.residual
    return w.dtype if r is None else torch.promote_types(w.dtype, r.dtype)
