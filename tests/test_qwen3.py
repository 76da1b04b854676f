"""The reference Qwen3 model: the fused layers compute the plain math, checkpoints load by
their Hugging Face names, seeded weights are deterministic, eager stays few ops.

The reference here is the model written out op by op (separate q/k/v and gate/up
projections, RMSNorm and rotary as textbook formulas, the residual added after each block),
run on weights split from the model's merged ones; float32 on the CPU, within 1e-5.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xgraph import InputError, PagedKVCache
from xgraph.attention import attention, eager_attention
from xgraph.models import Qwen3Config, Qwen3Model, Workload
from xgraph.models.qwen3 import hf_parameters
from xgraph.runners import PagedDecodeRunner, PagedPrefillRunner

TOL = 1e-5


def hf_state(model: Qwen3Model) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names, merged projections split again."""
    c = model.config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, w in zip(("q", "k", "v"), t.split([q, kv, kv])):
                out[f"{base}{part}_proj.weight"] = w.clone()
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            for part, w in zip(("gate", "up"), t.split([inter, inter])):
                out[f"{base}{part}_proj.weight"] = w.clone()
        elif not (name == "lm_head.weight" and c.tie_word_embeddings):
            out[name] = t.clone()
    return out


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w.float()).to(x.dtype)


def _rotary(x: torch.Tensor, positions: torch.Tensor, c: Qwen3Config) -> torch.Tensor:
    d = c.head_dim
    inv = 1.0 / c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def reference_forward(model: Qwen3Model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The same model, op by op, on its checkpoint-named weights."""
    c, w, eps = model.config, hf_state(model), model.config.rms_norm_eps
    t = ids.shape[0]
    x = w["model.embed_tokens.weight"][ids]
    for i, kv in enumerate(model.kv_cache.layers):
        p = f"model.layers.{i}."
        h = _norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, c.num_heads, c.head_dim)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, c.num_kv_heads, c.head_dim)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, c.num_kv_heads, c.head_dim)
        q = _rotary(_norm(q, w[p + "self_attn.q_norm.weight"], eps), pos, c)
        k = _rotary(_norm(k, w[p + "self_attn.k_norm.weight"], eps), pos, c)
        o = attention(q, k, v, kv, scale=c.head_dim**-0.5).reshape(t, -1)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _norm(x, w["model.norm.weight"], eps)


def _run(model: Qwen3Model, step, forward) -> torch.Tensor:  # type: ignore[no-untyped-def]
    runner = PagedDecodeRunner() if step.attn.is_decode else PagedPrefillRunner()
    with torch.no_grad(), eager_attention(runner, step.attn.metadata()):
        return forward(step.input_ids, step.positions)


def test_fused_layers_compute_the_plain_math():
    fused, plain = Workload.tiny(seed=4), Workload.tiny(seed=4)
    for w in (fused, plain):
        w.randomize_cache(1)
    rng = random.Random(2)
    steps = [fused.prefill_step(rng, [7, 3], [0, 5]), fused.decode_step(rng, 5)]
    for step in steps:
        out = _run(fused.model, step, fused.model.forward)
        ref = _run(plain.model, step, lambda i, p: reference_forward(plain.model, i, p))
        torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
        for a, b in zip(fused.cache.tensors(), plain.cache.tensors()):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def test_checkpoint_names_load_and_merge(tmp_path):
    from safetensors.torch import save_file

    src = Qwen3Model.build("tiny", num_blocks=8, block_size=4, seed=7)
    save_file(hf_state(src), str(tmp_path / "model.safetensors"))
    c = src.config
    hf_config = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    loaded = Qwen3Model.build("tiny", num_blocks=8, block_size=4, weights=str(tmp_path))
    assert loaded.config == c
    for (name, a), b in zip(src.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    # an incomplete checkpoint is refused, naming what is missing
    state = hf_state(src)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"gate_up_proj.*unexpected.*gate_proj"):
        loaded.load_hf_state(state)


def test_seeded_weights_are_deterministic_and_drawn_in_checkpoint_order():
    a, b = (Qwen3Model.build("tiny", num_blocks=4, seed=3) for _ in range(2))
    other = Qwen3Model.build("tiny", num_blocks=4, seed=4)
    for (name, x), y, z in zip(
        a.state_dict().items(), b.state_dict().values(), other.state_dict().values()
    ):
        assert torch.equal(x, y) and not torch.equal(x, z), name
    g = torch.Generator().manual_seed(3)
    drawn = {n: torch.randn(s, generator=g) for n, s in hf_parameters(a.config)}
    q = a.model.layers[0].self_attn.qkv_proj.weight[: a.config.num_heads * a.config.head_dim]
    assert torch.equal(q, 0.02 * drawn["model.layers.0.self_attn.q_proj.weight"])
    norm = a.model.layers[1].post_attention_layernorm.weight
    assert torch.equal(norm, 1.0 + 0.1 * drawn["model.layers.1.post_attention_layernorm.weight"])


def test_untied_head_loads_and_draws_its_own_weights():
    c = dataclasses.replace(Qwen3Config.tiny(), tie_word_embeddings=False)
    m = Qwen3Model.build(c, num_blocks=4, seed=1)
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    assert hf_parameters(c)[-1] == ("lm_head.weight", (c.vocab_size, c.hidden_size))


class _Ops(TorchDispatchMode):
    """Counts the ops that launch work (views left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        rets = func._schema.returns
        self.n += not (rets and all(r.alias_info and not r.alias_info.is_write for r in rets))
        return func(*args, **(kwargs or {}))


class _NoAttention(PagedDecodeRunner):
    def run(self, *args: object) -> None:
        pass


def test_eager_layers_stay_few_ops():
    """One decoder layer, attention left out: 3 RMSNorms (one op where torch has a fused
    kernel, CUDA; 5-6 on the CPU), 4 GEMMs, 2 residual adds, the per-head norm weight, rotary
    (roll, 2 mul, add), SwiGLU (silu, mul). The unfused layer took 53 on the CPU."""
    w = Workload.tiny()
    step = w.decode_step(random.Random(0), 4)
    x = torch.randn(4, w.model.config.hidden_size)
    cos_sin = w.model.rotary(step.positions)
    with torch.no_grad(), eager_attention(_NoAttention(), step.attn.metadata()):
        with _Ops() as ops:
            w.model.model.layers[0](x, x, cos_sin, w.cache.layers[0])
    assert ops.n - 1 <= 31, ops.n  # the 1: attention's output buffer


def test_a_config_whose_kv_heads_do_not_divide_the_heads_is_refused():
    with pytest.raises(InputError, match=r"num_heads \(num_attention_heads\) = 4 is not a mult"):
        dataclasses.replace(Qwen3Config.tiny(), num_kv_heads=3)
    with pytest.raises(InputError, match=r"num_kv_heads \(num_key_value_heads\) must be a pos"):
        dataclasses.replace(Qwen3Config.tiny(), num_kv_heads=0)
    with pytest.raises(InputError, match="head_dim = 15 is odd"):
        dataclasses.replace(Qwen3Config.tiny(), head_dim=15)


def test_from_hf_refuses_such_a_config_naming_its_fields(tmp_path):
    c = dataclasses.asdict(Qwen3Config.tiny())
    hf = {
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 4,
        "head_dim": 16,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(InputError, match=r"num_attention_heads.*num_key_value_heads"):
        Qwen3Config.from_hf(str(tmp_path))


def test_a_cache_the_model_cannot_write_is_refused_at_construction():
    c = Qwen3Config.tiny()
    half = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 8, 4, torch.bfloat16)
    with pytest.raises(InputError, match=r"dtype torch.bfloat16 differs from the model's torch.f"):
        Qwen3Model(c, half)
    narrow = PagedKVCache(c.num_layers, 1, c.head_dim, 8, 4)
    with pytest.raises(InputError, match=r"\(layers, kv heads, head_dim\) = \(2, 1, 16\)"):
        Qwen3Model(c, narrow)
    # made together, they agree whatever the dtype
    m = Qwen3Model.build("tiny", num_blocks=8, block_size=4, dtype=torch.bfloat16)
    assert m.kv_cache.dtype is torch.bfloat16 and m.lm_head.weight.dtype is torch.bfloat16
    assert m.rotary.table.dtype is torch.float32


def test_a_model_converted_after_construction_is_refused_at_its_first_step():
    w = Workload.tiny(max_blocks=6, max_seqs=8)
    w.model.to(torch.float64)  # the cache stays float32
    step = w.decode_step(random.Random(0), 2)
    with pytest.raises(InputError, match=r"float32 differs from the model's torch\.float64"):
        w.eager(step)


def test_bf16_build_matches_the_float32_weights_rounded():
    """The weights are made in their dtype now: the same values as float32 weights cast."""
    a = Qwen3Model.build("tiny", num_blocks=8, block_size=4, dtype=torch.bfloat16, seed=3)
    b = Qwen3Model.build("tiny", num_blocks=8, block_size=4, seed=3)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y.to(torch.bfloat16)), name
