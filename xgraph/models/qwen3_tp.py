"""The reference Qwen3 decoder, tensor-parallel over a torch.distributed group.

Megatron-style sharding, each rank holding 1/tp of every projection:

- attention: qkv column-parallel (this rank's query heads and their kv heads; kv heads are
  replicated when there are fewer than ranks), o_proj row-parallel, then an all-reduce;
- MLP: gate/up column-parallel, down_proj row-parallel, then an all-reduce;
- embedding vocab-parallel (each rank looks up its slice of the vocabulary, zeros elsewhere,
  then an all-reduce), and the tied lm_head vocab-parallel (each rank's slice of the logits,
  then an all-gather): the vocabulary is the largest matrix of small models.

Norms and rotary tables are replicated. The collectives are plain torch.distributed calls,
so the executor records them in the capture manifest and a graph captures them (NCCL inside
a CUDA graph, gloo on the CPU backend's recorded ops). Checkpoints load by their Hugging Face
names: the full tensors are sliced for this rank (`shard_hf_state`). With tp=1 it is the
single-rank model (`Qwen3Model`) computed the same way, by the same kernels: its outputs
equal that model's bit for bit (tests/test_tp_fidelity.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed.channel import all_gather_single
from ..metadata import KVCache
from ..paging import PagedKVCache
from .qwen3 import Qwen3Model, hf_parameters
from .qwen3_config import Qwen3Config
from .qwen3_layers import MLP, Attention, DecoderLayer, RMSNorm, Rotary


def qwen3_8b() -> Qwen3Config:
    """The shape of Qwen3-8B (36 layers, 32 q / 8 kv heads of 128, hidden 4096, untied)."""
    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=4096,
        intermediate_size=12_288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position=40_960,
        tie_word_embeddings=False,
    )


class Shard:
    """This rank's place in the tensor-parallel group and its slice of each dimension."""

    def __init__(self, c: Qwen3Config, group: Any = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        n = self.size
        if c.num_heads % n or c.intermediate_size % n or c.vocab_size % n:
            raise ValueError(
                f"tp={n} must divide the query heads ({c.num_heads}), the intermediate size "
                f"({c.intermediate_size}) and the vocabulary ({c.vocab_size})."
            )
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ValueError(f"tp={n} and {c.num_kv_heads} kv heads: one must divide the other.")
        self.heads = c.num_heads // n
        self.kv_heads = max(1, c.num_kv_heads // n)
        # the first kv head this rank holds (replicated kv heads: shared by tp / kv ranks)
        self.kv_first = self.rank * c.num_kv_heads // n
        self.inter = c.intermediate_size // n
        self.vocab = c.vocab_size // n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group; with a group of one too (a real collective, as on many ranks)."""
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x


def rows(t: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """Rows [i * n, (i + 1) * n) of t: the i-th of its n-row slices."""
    return t[i * n : (i + 1) * n]


def shard_hf_state(state: dict[str, torch.Tensor], c: Qwen3Config, s: Shard) -> dict:
    """This rank's tensors, by the model's own names, from a full Hugging Face state dict."""
    d = c.head_dim
    out: dict[str, torch.Tensor] = {}
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        q = rows(state[p + "self_attn.q_proj.weight"], s.rank, s.heads * d)
        k = state[p + "self_attn.k_proj.weight"][s.kv_first * d : (s.kv_first + s.kv_heads) * d]
        v = state[p + "self_attn.v_proj.weight"][s.kv_first * d : (s.kv_first + s.kv_heads) * d]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        o = state[p + "self_attn.o_proj.weight"]
        out[p + "self_attn.o_proj.weight"] = o[:, s.rank * s.heads * d : (s.rank + 1) * s.heads * d]
        gate = rows(state[p + "mlp.gate_proj.weight"], s.rank, s.inter)
        up = rows(state[p + "mlp.up_proj.weight"], s.rank, s.inter)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
        down = state[p + "mlp.down_proj.weight"]
        out[p + "mlp.down_proj.weight"] = down[:, s.rank * s.inter : (s.rank + 1) * s.inter]
        for name in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm"):
            out[p + name + ".weight"] = state[p + name + ".weight"]
        out[p + "post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
    out["model.norm.weight"] = state["model.norm.weight"]
    out["model.embed_tokens.weight"] = rows(state["model.embed_tokens.weight"], s.rank, s.vocab)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = rows(state["lm_head.weight"], s.rank, s.vocab)
    return out


def random_hf_state(c: Qwen3Config, seed: int) -> dict[str, torch.Tensor]:
    """The full weights `Qwen3Model.init_random(seed)` draws, by checkpoint name."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in hf_parameters(c):
        r = torch.randn(shape, generator=g, device="cpu")  # host draws, any default device
        state[name] = 1.0 + 0.1 * r if name.endswith("norm.weight") else 0.02 * r
    return state


class TPAttention(Attention):
    """This rank's query heads and their kv heads; o_proj row-parallel, then all-reduced."""

    def __init__(self, c: Qwen3Config, s: Shard) -> None:
        super().__init__(c, s.heads, s.kv_heads)
        self.s = s

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        return self.s.all_reduce(super().forward(x, cos_sin, kv_cache))


class TPMLP(MLP):
    """SwiGLU over this rank's slice of the intermediate size; down_proj all-reduced."""

    def __init__(self, c: Qwen3Config, s: Shard) -> None:
        super().__init__(c, s.inter)
        self.s = s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.s.all_reduce(super().forward(x))


class _Body(nn.Module):
    def __init__(self, c: Qwen3Config, s: Shard) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, TPAttention(c, s), TPMLP(c, s)) for _ in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3TPModel(nn.Module):
    """Qwen3-style decoder sharded over `group`; `forward` returns final hidden states,
    `forward_logits` the full vocabulary's logits on every rank."""

    def __init__(self, config: Qwen3Config, kv_cache: PagedKVCache, group: Any = None) -> None:
        super().__init__()
        self.config = config
        self.kv_cache = kv_cache
        self.shard = Shard(config, group)
        self.model = _Body(config, self.shard)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, self.shard.vocab, bias=False)
        self.rotary = Rotary(config.head_dim, config.max_position, config.rope_theta)

    @classmethod
    def build(
        cls,
        config: Qwen3Config | str,
        group: Any = None,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        state: dict[str, torch.Tensor] | None = None,
        random_shards: bool = False,
    ) -> Qwen3TPModel:
        """This rank's shard of a full state dict (HF names), or of `Qwen3Model`'s seeded
        weights; `random_shards`: each rank draws its own shard on the device instead (large
        shapes, where only the shapes matter: not equal to any single-rank model)."""
        c = Qwen3Config.named(config) if isinstance(config, str) else config
        s = Shard(c, group)
        cache = PagedKVCache(
            c.num_layers, s.kv_heads, c.head_dim, num_blocks, block_size, dtype, device
        )
        with torch.device("meta"):
            model = cls(c, cache, group)
        model = model.to_empty(device=device)
        if random_shards:
            model.init_shards(seed)
        else:
            full = state if state is not None else random_hf_state(c, seed)
            model.load_state_dict(shard_hf_state(full, c, s))
        model = model.to(dtype).eval().requires_grad_(False)
        model.rotary = Rotary(c.head_dim, c.max_position, c.rope_theta).to(device)
        return model

    @torch.no_grad()
    def init_shards(self, seed: int) -> None:
        """Seeded weights drawn per rank, on the parameters' device (norms 1 + 0.1 N(0, 1))."""
        dev = next(self.parameters()).device
        g = torch.Generator(device=dev).manual_seed(seed * 1009 + self.shard.rank)
        for name, p in self.named_parameters():
            p.normal_(0.0, 1.0, generator=g)
            if name.endswith("norm.weight"):
                p.mul_(0.1).add_(1.0)
            else:
                p.mul_(0.02)

    inputs = Qwen3Model.inputs  # the executor's declared inputs, bounds from the config

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows, zeros for the others', all-reduced."""
        s = self.shard
        local = input_ids - s.rank * s.vocab
        outside = (local < 0) | (local >= s.vocab)
        x = F.embedding(local.masked_fill(outside, 0), self.model.embed_tokens.weight)
        return s.all_reduce(x.masked_fill(outside[:, None], 0.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = torch.zeros_like(x)
        cos_sin = self.rotary(positions)
        for layer, kv in zip(self.model.layers, self.kv_cache.layers):
            x, residual = layer(x, residual, cos_sin, kv)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lm_head: this rank's slice of the logits, all-gathered. F.linear,
        as `Qwen3Model`'s lm_head (an nn.Linear) runs it, not `xgraph.linear`: over a group
        of one the same kernels run as in the single-rank model, so the logits are its bit
        for bit (a backend's linear kernel rounds otherwise)."""
        s = self.shard
        w = (
            self.model.embed_tokens.weight
            if self.config.tie_word_embeddings
            else self.lm_head.weight
        )
        part = F.linear(hidden, w)
        if s.group is None:
            return part
        out = part.new_empty((s.size * part.shape[0], part.shape[1]))
        all_gather_single(out, part.contiguous(), group=s.group)
        return out.view(s.size, part.shape[0], s.vocab).permute(1, 0, 2).reshape(part.shape[0], -1)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.forward(input_ids, positions))
