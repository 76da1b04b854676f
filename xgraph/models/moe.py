"""A small MoE decoder with expert parallelism: data-parallel attention, expert-parallel MLP.

Each rank of the expert-parallel group holds `num_experts / ep` experts and runs attention
on its own batch (its own KV cache). The MoE block routes each token to its top-k experts
and moves it to the rank holding each one with an all-to-all, the experts run, and a second
all-to-all brings the results back (dispatch and combine). Every rank sends `capacity` slots
to every peer, so the all-to-alls have the same shape on all ranks whatever each one's
token count: capacity = top_k * max(the step's communication size, local tokens), the
communication size being the largest token count of the group as the executor agreed it
(`xgraph.distributed.comm_size`, a key dim of the graph). Positions inside a peer's slots
come from a cumulative count on the device, so nothing reads device data on the host and
the block captures as a graph. With ep=1 it is the dense MoE, computed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed.lockstep import comm_size
from ..linear import linear
from ..paging import PagedKVCache
from .qwen3 import Qwen3Model
from .qwen3_config import Qwen3Config
from .qwen3_layers import Attention, RMSNorm, Rotary

COMM_DIM = "num_comm_tokens"


@dataclass(frozen=True)
class MoEConfig:
    """The attention shape (a Qwen3Config) plus the experts'."""

    base: Qwen3Config
    num_experts: int = 4
    top_k: int = 2
    expert_size: int = 32

    @classmethod
    def tiny(cls) -> MoEConfig:
        return cls(replace(Qwen3Config.tiny(), num_layers=1))


class EPMoE(nn.Module):
    """Top-k routed SwiGLU experts spread over `group` (all-to-all dispatch and combine)."""

    def __init__(self, c: MoEConfig, group: Any = None) -> None:
        super().__init__()
        self.group = group
        self.ep = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if c.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide num_experts={c.num_experts}.")
        self.local, self.top_k, h = c.num_experts // self.ep, c.top_k, c.base.hidden_size
        self.router = nn.Linear(h, c.num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(self.local, 2 * c.expert_size, h))
        self.down = nn.Parameter(torch.empty(self.local, h, c.expert_size))

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep == 1:
            return x
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h, k, ep = x.shape[0], x.shape[1], self.top_k, self.ep
        weights, experts = torch.topk(linear(x, self.router.weight).float().softmax(-1), k)
        weights = weights / weights.sum(-1, keepdim=True)
        cap = k * max(comm_size(COMM_DIM) if ep > 1 else t, t)  # slots per peer, alike on all
        dest = (experts // self.local).reshape(-1)  # the rank of each (token, choice)
        onehot = (dest[:, None] == torch.arange(ep, device=x.device)).to(torch.int64)
        pos = (onehot.cumsum(0) * onehot).sum(1) - 1  # its place among those sent there
        slot = dest * cap + pos
        send = x.new_zeros((ep * cap, h)).index_copy_(
            0, slot, x[:, None].expand(t, k, h).reshape(-1, h)
        )
        which = torch.full((ep * cap,), -1, dtype=torch.int64, device=x.device)
        which.index_copy_(0, slot, (experts % self.local).reshape(-1))
        recv, recv_which = self._all_to_all(send), self._all_to_all(which)
        y = torch.zeros_like(recv)
        for j in range(self.local):
            gate, up = linear(recv, self.gate_up[j]).chunk(2, -1)
            yj = linear(F.silu(gate) * up, self.down[j])
            y += yj * (recv_which == j)[:, None].to(y.dtype)
        back = self._all_to_all(y).index_select(0, slot).view(t, k, h)
        return (back * weights[..., None].to(back.dtype)).sum(1)


class MoELayer(nn.Module):
    def __init__(self, c: MoEConfig, group: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.base.hidden_size, c.base.rms_norm_eps)
        self.self_attn = Attention(c.base)
        self.post_attention_layernorm = RMSNorm(c.base.hidden_size, c.base.rms_norm_eps)
        self.mlp = EPMoE(c, group)


class MoEModel(nn.Module):
    """Embedding, decoder layers of local attention and an EP MoE, norm, tied lm_head."""

    def __init__(self, c: MoEConfig, kv_cache: PagedKVCache, group: Any = None) -> None:
        super().__init__()
        b = c.base
        self.config, self.moe_config, self.kv_cache = b, c, kv_cache
        self.embed_tokens = nn.Embedding(b.vocab_size, b.hidden_size)
        self.layers = nn.ModuleList(MoELayer(c, group) for _ in range(b.num_layers))
        self.norm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.rotary = Rotary(b.head_dim, b.max_position, b.rope_theta)

    @classmethod
    def build(
        cls,
        c: MoEConfig,
        group: Any = None,
        *,
        num_blocks: int,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> MoEModel:
        """Seeded weights, the same on every rank; each rank keeps its own experts."""
        b = c.base
        cache = PagedKVCache(
            b.num_layers, b.num_kv_heads, b.head_dim, num_blocks, block_size, dtype, device
        )
        model = cls(c, cache, group)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                full = _full_shape(name, p, c)
                w = torch.randn(full, generator=g, device="cpu")
                w = 1.0 + 0.1 * w if name.endswith("norm.weight") else 0.02 * w
                if full != p.shape:  # experts: this rank's slice of all of them
                    w = w[model.layers[0].mlp.rank * p.shape[0] :][: p.shape[0]]
                p.copy_(w)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    inputs = Qwen3Model.inputs  # the executor's declared inputs, bounds from the config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = torch.zeros_like(x)
        cos_sin = self.rotary(positions)
        for layer, kv in zip(self.layers, self.kv_cache.layers):
            h, residual = layer.input_layernorm(x, residual)
            h = layer.self_attn(h, cos_sin, kv)
            h, residual = layer.post_attention_layernorm(h, residual)
            x = layer.mlp(h)
        return self.norm(x, residual)[0]

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return linear(self.forward(input_ids, positions), self.embed_tokens.weight)


def _full_shape(name: str, p: torch.Tensor, c: MoEConfig) -> tuple[int, ...]:
    """A parameter's shape before expert sharding (experts are drawn for every rank alike)."""
    if name.endswith(("mlp.gate_up", "mlp.down")):
        return (c.num_experts, *p.shape[1:])
    return tuple(p.shape)
