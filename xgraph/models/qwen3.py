"""A Qwen3-style decoder in plain torch with a paged KV cache: the reference workload.

RMSNorm, per-head QK-norm, grouped-query attention, neox RoPE and a SwiGLU MLP, with
merged qkv and gate/up projections; the layers pass the residual stream, each projection
carrying the ops around it as a fusion (`xgraph.fusion`: the backend's fused kernel where it
has one, the unfused ops where not; layers in `qwen3_layers`). Hugging Face checkpoints load
by their own parameter names (the split projections are merged on load). Attention goes
through `xgraph.attention`, so one model runs eager, as a full graph and piecewise, and
compiled (`compile_forward`: the whole forward as one graph with the token count dynamic,
one compile for every bucket; or `compile_layers`: each layer; the call site is a custom
op, not a graph break). Everything in the forward is
graph-safe: no host reads, no host scalars derived from tensors, positions and cache slots
come in as device tensors.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..buckets import Input
from ..compiled import TokenCompiled
from ..errors import InputError
from ..linear import stream_dtype
from ..paging import PagedKVCache
from .qwen3_config import Qwen3Config
from .qwen3_layers import DecoderLayer, RMSNorm, Rotary

__all__ = ["Qwen3Config", "Qwen3Model", "hf_parameters"]


def hf_parameters(c: Qwen3Config) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint parameter names and shapes, in the order of a Hugging Face Qwen3 model."""
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c.vocab_size, h))]
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (c.num_heads * d, h)),
            (p + "self_attn.k_proj.weight", (c.num_kv_heads * d, h)),
            (p + "self_attn.v_proj.weight", (c.num_kv_heads * d, h)),
            (p + "self_attn.o_proj.weight", (h, c.num_heads * d)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", (c.vocab_size, h)))
    return out


def draws(config: Qwen3Config, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights, (Hugging Face name, float32 host tensor) per parameter in
    checkpoint order from one host generator: norm weights 1 + 0.1 N(0, 1), the rest
    0.02 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    for name, shape in hf_parameters(config):
        r = torch.randn(shape, generator=g, device="cpu")  # host draws, any default device
        yield name, (1.0 + 0.1 * r if name.endswith("norm.weight") else 0.02 * r)


def parameter_count(c: Qwen3Config) -> int:
    """How many parameters a checkpoint of this shape holds."""
    return sum(math.prod(shape) for _, shape in hf_parameters(c))


def _under_dispatch_mode() -> bool:
    """Whether eager code runs under a dispatch mode (a host graph recording ops, capture
    checks). Compiled layers would run eagerly there anyway, and torch 2.13 would also mark
    their code as never to compile again (pytorch/pytorch#190286), so the forward calls the
    layers' plain forwards instead."""
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() > 0


class _Body(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def _check_cache(c: Qwen3Config, cache: PagedKVCache, dtype: torch.dtype) -> None:
    """Refuse a cache the model's attention cannot write, naming what differs."""
    if cache.dtype != dtype:
        raise InputError(
            f"Qwen3Model: the KV cache's dtype {cache.dtype} differs from the model's {dtype}; "
            "the attention stores the model's k/v in it. Make the PagedKVCache with "
            f"dtype={dtype} (Qwen3Model.build makes both with its dtype=)."
        )
    want = (c.num_layers, c.num_kv_heads, c.head_dim)
    k = cache.layers[0][0] if cache.layers else None
    have = (len(cache.layers), *(tuple(k.shape[2:]) if k is not None else (0, 0)))
    if have != want:
        raise InputError(
            "Qwen3Model: the KV cache holds (layers, kv heads, head_dim) = "
            f"{have}, the config {want} (num_layers, num_kv_heads, head_dim). Make the "
            "PagedKVCache from the same config."
        )


class Qwen3Model(nn.Module):
    """Qwen3-style decoder over a PagedKVCache; `forward` returns final hidden states.

    `dtype` is the weights' dtype (default torch's default dtype); the cache must have it.
    """

    def __init__(
        self, config: Qwen3Config, kv_cache: PagedKVCache, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        _check_cache(config, kv_cache, dtype)
        self.config = config
        self.kv_cache = kv_cache
        self.model = _Body(config).to(dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config.head_dim, config.max_position, config.rope_theta)

    def inputs(self) -> list[Input]:
        """The forward's inputs as an executor declares them, with their bounds: token ids
        in [0, vocab_size), positions in [0, max_position) (the rotary table), so a step
        outside them is refused (InputError) before anything runs."""
        c = self.config
        return [
            Input("input_ids", torch.int64, ("num_tokens",), bounds=(0, c.vocab_size)),
            Input("positions", torch.int64, ("num_tokens",), bounds=(0, c.max_position)),
        ]

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
        draw_on_device: bool | None = None,
    ) -> Qwen3Model:
        """Random weights (seeded, std 0.02), or a local Hugging Face safetensors folder.

        `draw_on_device`: draw the random weights on `device` (`init_on_device`) instead of
        the host; None (default): on the device for shapes of more than 2e9 parameters
        (qwen3-8b: the host would take minutes), on the host otherwise."""
        if isinstance(config, str):
            config = Qwen3Config.from_hf(weights) if weights else Qwen3Config.named(config)
        cache = PagedKVCache(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            num_blocks,
            block_size,
            dtype,
            device,
        )
        with torch.device("meta"):
            model = cls(config, cache, dtype)
        model = model.to_empty(device=device)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        if draw_on_device is None:
            draw_on_device = parameter_count(config) > 2e9
        if weights:
            model.load_safetensors(weights)
        elif draw_on_device:
            model.init_on_device(seed)
        else:
            model.init_random(seed)
        model = model.to(dtype).eval().requires_grad_(False)
        # the rotary table stays float32 whatever the weights' dtype
        model.rotary = Rotary(config.head_dim, config.max_position, config.rope_theta).to(device)
        model.mark_cache_static()
        return model

    def init_random(self, seed: int) -> None:
        """Seeded weights: drawn per checkpoint parameter in checkpoint order (norm weights
        1 + 0.1 N(0, 1), the rest 0.02 N(0, 1)), then loaded like a checkpoint."""
        self.load_hf_state(dict(draws(self.config, seed)), f"init_random({seed})")

    @torch.no_grad()
    def init_on_device(self, seed: int) -> None:
        """Seeded weights drawn on the parameters' device, in their dtype (norm weights
        1 + 0.1 N(0, 1), the rest 0.02 N(0, 1)): the same seed gives the same weights on the
        same kind of device, not the host's `init_random` weights."""
        dev = self.model.embed_tokens.weight.device
        g = torch.Generator(device=dev).manual_seed(seed)
        for name, p in self.named_parameters():
            p.normal_(0.0, 1.0, generator=g)
            if name.endswith("norm.weight"):
                p.mul_(0.1).add_(1.0)
            else:
                p.mul_(0.02)

    def load_safetensors(self, folder: str) -> None:
        from safetensors.torch import load_file  # optional dependency

        # read onto the parameters' device: the merges into fused projections run there
        device = str(self.model.embed_tokens.weight.device)
        state: dict[str, torch.Tensor] = {}
        for fn in sorted(os.listdir(folder)):
            if fn.endswith(".safetensors"):
                state.update(load_file(os.path.join(folder, fn), device=device))
        self.load_hf_state(state, folder)

    def load_hf_state(self, state: dict[str, torch.Tensor], source: str = "state") -> None:
        """Load a state dict with Hugging Face names (split projections are merged)."""
        state = dict(state)
        tied = self.config.tie_word_embeddings
        if tied:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and tied)]
        if missing or unexpected:
            raise ValueError(
                f"Weights in {source} do not fit: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        weights = self.model.embed_tokens.weight.dtype
        if weights != self.kv_cache.dtype:  # converted since construction (model.to(...))
            _check_cache(self.config, self.kv_cache, weights)
        x = self.model.embed_tokens(input_ids)
        x = x.to(stream_dtype(x))  # the residual stream: float32 over fused kernels
        cos_sin = self.rotary(positions)  # gathered once for every layer
        plain = _under_dispatch_mode()
        for layer, kv in zip(self.model.layers, self.kv_cache.layers):
            x, _ = (layer.forward if plain else layer)(x, None, cos_sin, kv)
        norm = self.model.norm
        return (norm.forward if plain else norm)(x)[0].to(weights)

    def compile_layers(self, **options: object) -> Qwen3Model:
        """torch.compile each decoder layer whole (norms, attention block with the attention
        custom op, MLP) and the final norm, in place. The layers share code and shapes, so
        they share one compiled graph. Run it under an executor made with `compiled=True`.

        `dynamic=True` unless given: num_tokens is symbolic, so one graph serves every
        bucket of 2 tokens or more and one more the specialised single token (decode at
        batch 1), instead of a compile per bucket (faster to capture from the third bucket
        on; docs/model-adaptation.md has the numbers). The cache tensors stay static: their
        sizes are fixed, and symbolic ones could be unified with num_tokens by equal values.
        `dynamic=False` compiles once per token count instead, each specialised to its shape
        (faster kernels for a few decode buckets; more buckets than
        torch._dynamo.config.recompile_limit fall back to running uncompiled).
        """
        options.setdefault("dynamic", True)
        self.mark_cache_static()
        for layer in self.model.layers:
            layer.compile(**options)  # type: ignore[arg-type]
        self.model.norm.compile(**options)  # type: ignore[arg-type]
        return self

    def compile_forward(
        self, max_tokens: int, *, logits: bool = False, dynamic: bool = True, **options: Any
    ) -> TokenCompiled:
        """The whole forward (`logits=True`: forward_logits) compiled as one graph, the
        attention custom op inside it, the token count dynamic within [2, max_tokens]: one
        compile serves every bucket up to max_tokens, one more the single token (see
        xgraph.compiled.TokenCompiled; `dynamic=False`: one compile per token count).
        `options`: TokenCompiled's (backend="inductor", fullgraph=True, ...). Pass the result
        to an executor made with `compiled=True` as its forward."""
        fn = self.forward_logits if logits else self.forward
        static = list(self.kv_cache.tensors())  # marked by TokenCompiled (its `static`)
        return TokenCompiled(
            fn, max_tokens, dynamic=dynamic, name="qwen3", static=static, **options
        )

    def mark_cache_static(self) -> None:
        """Keep the cache tensors' sizes static under torch.compile(dynamic=True) (build()
        calls it; torch.compile(model.forward) needs nothing else)."""
        for t in self.kv_cache.tensors():
            torch._dynamo.mark_static(t)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """forward followed by the LM head, as one capturable callable."""
        return self.compute_logits(self.forward(input_ids, positions))
