"""The layers of the reference Qwen3 decoder, written for few kernels eager and for fusion.

Projections are merged (one `qkv_proj`, one `gate_up_proj` GEMM) and run through
`xgraph.linear.linear` (the backend's kernel where it has a faster one). A layer runs in one
of two forms, the same math in the same order:

- the stream form (`forward(x, None, ...)`, the single-rank model): x is the residual
  stream, and each projection carries the ops around it as a `Fusion`: the input RMSNorm and
  the per-head QK-norm + rotary with the qkv projection, the residual add with o_proj, the
  post-attention RMSNorm with gate/up, SiLU-mul and the residual add with down_proj. Where
  the backend has a fused kernel that is five launches a layer with attention; where not,
  `xgraph.fusion.reference` runs the unfused ops, bit for bit the second form's;
- the folded form (`forward(x, residual, ...)`, the TP model, whose all-reduce sits between
  a projection and its residual add): the residual add folded into the next RMSNorm
  (vLLM-style `norm(x, residual) -> (normed, residual)`), QK-norm and rotary over the q and
  k heads together.

Math stays in float32 and is cast back to the model dtype where the unfused model casts, so
an fp32 model matches it to rounding. Hugging Face checkpoints keep loading by their names:
a state-dict pre-hook merges q/k/v_proj and gate/up_proj weights into the merged layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import attention
from ..fusion import Fusion, HeadNorm, apply_rotary, rms_norm
from ..linear import linear
from ..metadata import KVCache
from .qwen3_config import Qwen3Config

__all__ = ["MLP", "Attention", "DecoderLayer", "RMSNorm", "Rotary", "apply_rotary", "rms_norm"]


def _merge_on_load(module: nn.Module, merged: str, parts: Sequence[str]) -> None:
    """Let `module` load a checkpoint that stores `merged` as separate `parts` (row blocks)."""

    def hook(mod: nn.Module, state: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
        names = [f"{prefix}{p}.weight" for p in parts]
        if all(n in state for n in names):
            state[f"{prefix}{merged}.weight"] = torch.cat([state.pop(n) for n in names])

    module.register_load_state_dict_pre_hook(hook)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; with `residual`, the residual add is folded in first."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""
        if residual is not None:
            x = x + residual
        return rms_norm(x, self.weight, self.eps), x


class Rotary(nn.Module):
    """neox rotary tables, gathered once per step for every layer.

    `table[p]` holds [cos, cos] and [-sin, sin] for position p (float32), so rotating x is
    x * cos + roll(x, dim / 2) * sin: the same products and sums as the half-split form.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = ang.cos().float(), ang.sin().float()
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)
        self.register_buffer("table", table, persistent=False)  # [max_position, 2, head_dim]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """[tokens, 2, head_dim]: this step's cos and signed sin rows."""
        return self.table[positions]


class Attention(nn.Module):
    """GQA self-attention: merged qkv GEMM, QK-norm and rotary over q and k at once."""

    def __init__(self, c: Qwen3Config, heads: int | None = None, kv_heads: int | None = None):
        """`heads`, `kv_heads`: the heads this module holds (default all; a TP shard's)."""
        super().__init__()
        hq = c.num_heads if heads is None else heads
        hkv = c.num_kv_heads if kv_heads is None else kv_heads
        self.heads, self.kv_heads, self.head_dim = hq, hkv, c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, (hq + 2 * hkv) * c.head_dim, bias=False)
        self.o_proj = nn.Linear(hq * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.scale = c.head_dim**-0.5
        _merge_on_load(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Attention of x (already normed); with `norm`, x is the residual stream and the
        result the stream after attention (`fused`)."""
        if norm is not None:
            return self.fused(x, norm, cos_sin, kv_cache)
        t, hq, hkv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = linear(x, self.qkv_proj.weight).view(t, hq + 2 * hkv, d)
        # per-head norm weights: q's for the first hq heads, k's for the next hkv
        w = torch.cat([self.q_norm.weight.expand(hq, d), self.k_norm.weight.expand(hkv, d)])
        qk = apply_rotary(rms_norm(qkv[:, : hq + hkv], w, self.q_norm.eps), cos_sin)
        o = attention(qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :], kv_cache, scale=self.scale)
        return linear(o.reshape(t, hq * d), self.o_proj.weight)

    def fused(
        self, h: torch.Tensor, norm: RMSNorm, cos_sin: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        """The stream after attention: h + o_proj(attention(qkv(norm(h)))), the norm, QK-norm
        and rotary fused with the qkv projection and the residual add with o_proj."""
        t, hq, hkv, d = h.shape[0], self.heads, self.kv_heads, self.head_dim
        heads = HeadNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos_sin, hq, hkv)
        qkv = linear(h, self.qkv_proj.weight, Fusion(norm.weight, norm.eps, heads=heads))
        qkv = qkv.view(t, hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        o = attention(q, k, v, kv_cache, scale=self.scale)
        return linear(o.reshape(t, hq * d), self.o_proj.weight, Fusion(residual=h))


class MLP(nn.Module):
    """SwiGLU over one merged gate/up GEMM."""

    def __init__(self, c: Qwen3Config, inter: int | None = None) -> None:
        """`inter`: the intermediate size this module holds (default all; a TP shard's)."""
        super().__init__()
        inter = c.intermediate_size if inter is None else inter
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, c.hidden_size, bias=False)
        _merge_on_load(self, "gate_up_proj", ("gate_proj", "up_proj"))

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """The MLP of x (already normed); with `norm`, x is the residual stream and the
        result the stream after the MLP (`fused`)."""
        if norm is not None:
            return self.fused(x, norm)
        gate, up = linear(x, self.gate_up_proj.weight).chunk(2, -1)
        return linear(F.silu(gate) * up, self.down_proj.weight)

    def fused(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The stream after the MLP (`fused_mlp`)."""
        return fused_mlp(h, self.gate_up_proj.weight, self.down_proj.weight, norm.weight, norm.eps)


def fused_mlp(
    h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """The residual stream h after a SwiGLU MLP: h + down(silu_mul(gate_up(rms_norm(h)))), the
    norm fused with the merged gate/up projection, SiLU-mul and the residual add with down."""
    return linear(linear(h, gate_up, Fusion(norm, eps)), down, Fusion(gated=True, residual=h))


class DecoderLayer(nn.Module):
    """One decoder layer. `forward(x, None, ...)`: x is the residual stream, and the layer
    returns (the stream after it, None), its adds fused into projections. `forward(x,
    residual, ...)`: returns (mlp output, residual), and the next layer (or the final norm)
    adds them, fused with its norm (the TP model's blocks all-reduce their outputs first)."""

    def __init__(
        self, c: Qwen3Config, attn: nn.Module | None = None, mlp: nn.Module | None = None
    ) -> None:
        """`attn` and `mlp` replace the single-rank blocks (the TP model passes its shards)."""
        super().__init__()
        self.self_attn = Attention(c) if attn is None else attn
        self.mlp = MLP(c) if mlp is None else mlp
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is None:  # the stream form
            # through the modules' calls, so hooks and launch sites see self_attn and mlp
            h = self.self_attn(x, cos_sin, kv_cache, norm=self.input_layernorm)
            return self.mlp(h, norm=self.post_attention_layernorm), None
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual
