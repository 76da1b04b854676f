"""A Qwen3-style decoder in plain torch with a paged KV cache: the reference workload.

RMSNorm, per-head QK-norm, grouped-query attention, neox RoPE and a SwiGLU MLP, with the
parameter names of the Hugging Face checkpoints so a local safetensors folder loads as is.
Attention goes through `xgraph.attention`, so one model runs eager, as a full graph and
piecewise. Everything in the forward is graph-safe: no host reads, no host scalars derived
from tensors, positions and cache slots come in as device tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import attention
from ..metadata import KVCache
from ..paging import PagedKVCache


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position: int = 8192
    tie_word_embeddings: bool = True

    @classmethod
    def tiny(cls) -> Qwen3Config:
        """Small enough for CPU tests: 2 layers, 4 query heads over 2 kv heads."""
        return cls(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position=2048,
        )

    @classmethod
    def qwen3_0_6b(cls) -> Qwen3Config:
        """The shape of Qwen3-0.6B (28 layers, 16 q / 8 kv heads of 128, hidden 1024)."""
        return cls(
            vocab_size=151_936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            max_position=40_960,
        )

    @classmethod
    def named(cls, name: str) -> Qwen3Config:
        table = {"tiny": cls.tiny, "qwen3-0.6b": cls.qwen3_0_6b}
        if name not in table:
            raise ValueError(f"Unknown model config {name!r}; choose one of {sorted(table)}.")
        return table[name]()

    @classmethod
    def from_hf(cls, folder: str) -> Qwen3Config:
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", 1e6),
            max_position=c.get("max_position_embeddings", 8192),
            tie_word_embeddings=c.get("tie_word_embeddings", True),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """neox-style rotary embedding; the cos/sin table is indexed by device positions."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.scale = c.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, kv_cache: KVCache
    ) -> torch.Tensor:
        t, c = x.shape[0], self.c
        q = self.q_norm(self.q_proj(x).view(t, c.num_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        q, k = rotary(q, positions), rotary(k, positions)
        o = attention(q, k, v, kv_cache, scale=self.scale)
        return self.o_proj(o.reshape(t, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class _Body(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3Model(nn.Module):
    """Qwen3-style decoder over a PagedKVCache; `forward` returns final hidden states."""

    def __init__(self, config: Qwen3Config, kv_cache: PagedKVCache) -> None:
        super().__init__()
        self.config = config
        self.kv_cache = kv_cache
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config.head_dim, config.max_position, config.rope_theta)

    @classmethod
    def build(
        cls,
        config: Qwen3Config | str,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        weights: str | None = None,
    ) -> Qwen3Model:
        """Random weights (seeded, std 0.02), or a local Hugging Face safetensors folder."""
        if isinstance(config, str):
            config = Qwen3Config.from_hf(weights) if weights else Qwen3Config.named(config)
        cache = PagedKVCache(
            config.num_layers, config.num_kv_heads, config.head_dim, num_blocks, block_size,
            dtype, device,
        )  # fmt: skip
        with torch.device("meta"):
            model = cls(config, cache)
        model = model.to_empty(device=device)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        if weights:
            model.load_safetensors(weights)
        else:
            model.init_random(seed)
        model = model.to(dtype).eval().requires_grad_(False)
        # the rotary table stays float32 whatever the weights' dtype
        model.rotary = Rotary(config.head_dim, config.max_position, config.rope_theta).to(device)
        return model

    def init_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))

    def load_safetensors(self, folder: str) -> None:
        from safetensors.torch import load_file  # optional dependency

        state: dict[str, torch.Tensor] = {}
        for fn in sorted(os.listdir(folder)):
            if fn.endswith(".safetensors"):
                state.update(load_file(os.path.join(folder, fn)))
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [
            m for m in missing if not (m == "lm_head.weight" and self.config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise ValueError(
                f"Weights in {folder} do not fit: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer, kv in zip(self.model.layers, self.kv_cache.layers):
            h = x + layer.self_attn(layer.input_layernorm(x), positions, self.rotary, kv)
            x = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(x)

    def compile_layers(self, **options: object) -> Qwen3Model:
        """torch.compile each layer's norms, attention block and MLP (in place): the layer
        code is shared, so the 28 layers reuse a handful of compiled graphs, and the
        attention call site stays a graph break between them. Run it under an executor
        made with `compiled=True`."""
        for layer in self.model.layers:
            for m in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                      layer.mlp):  # fmt: skip
                m.compile(**options)  # type: ignore[arg-type]
        self.model.norm.compile(**options)  # type: ignore[arg-type]
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """forward followed by the LM head, as one capturable callable."""
        return self.compute_logits(self.forward(input_ids, positions))
