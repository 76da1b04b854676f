"""A transformers Qwen3 model's layers over xgraph's fused projections (fusions.py).

The CPU backend has no fused kernel, so these tests give it one that computes each fusion's
reference ops (`xgraph.fusion.reference`): the layers then take the fused form, and what is
checked is that form's plumbing (merged weights, the rotary table, the attention call, the
float32 stream, giving the model back), against transformers' own forward.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, tiny  # noqa: E402

import xgraph  # noqa: E402
from xgraph.fusion import reference  # noqa: E402
from xgraph.integrations.transformers import GraphModel  # noqa: E402
from xgraph.integrations.transformers.fusions import fuse_layers, table  # noqa: E402
from xgraph.kernels import Kernels  # noqa: E402

NEW = [4, 3]


@pytest.fixture
def fused_cpu(monkeypatch):  # type: ignore[no-untyped-def]
    """The CPU backend with a linear kernel and a fused one (the fusions' reference ops)."""
    backend = xgraph.get_backend("cpu")
    kernels = Kernels(
        linear=lambda x, w: F.linear(x, w),
        fused_linear=lambda x, w, f: reference(x, w, f, F.linear),
    )
    monkeypatch.setattr(backend, "kernels", lambda: kernels)
    monkeypatch.setenv("XGRAPH_FUSE_LAYERS", "1")
    yield backend
    xgraph.linear.install("cpu", None, "cpu")  # what the CPU backend installs: nothing


def _sdpa(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    return ref


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 5)]


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_qwen3_layers_fuse_and_give_transformers_logits(fused_cpu, compile):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny("qwen3")
    ref = _sdpa(model)
    ps = _prompts()
    # compiled whole on request (the default scope leaves fused layers uncompiled)
    kw = dict(on_capture_error="raise", compile=compile, compile_cache=False)
    kw["compile_scope"] = "forward"
    with GraphModel(model, backend=fused_cpu, **kw, **LIMITS) as gm:
        assert gm.fused
        layers = model.model.layers
        assert all("forward" in layer.__dict__ for layer in layers)
        result = gm.generate(ps, max_new_tokens=NEW, record_logits=True)
        stats = gm.stats()
    if compile:  # the fused layers trace whole: no graph break, no eager fallback
        assert dict(counters["graph_break"]) == {} and stats["compile"]["fallback"] is None
    assert result.logits is not None
    for p, tokens, got in zip(ps, result.tokens, result.logits):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([p + tokens[:-1]])).logits[0]
        # the fusions' norms (F.rms_norm, weight applied in float32) differ from
        # transformers' in the last bits only
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert result.graph_steps["eager"] == 0
    # closed: the model's own forwards again, and it computes what it did
    mods = [*layers, model.model.rotary_emb]
    assert not any(n in m.__dict__ for m in mods for n in ("forward", "_xgraph_last"))
    ids = torch.tensor([ps[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_the_stream_between_layers_is_float32_and_the_last_layer_gives_bf16(fused_cpu):
    model = tiny("qwen3").to(torch.bfloat16)
    seen: list[torch.dtype] = []
    with GraphModel(model, backend=fused_cpu, on_capture_error="raise", **LIMITS) as gm:
        assert gm.fused
        hooks = [
            layer.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
            for layer in model.model.layers
        ]
        gm.generate(_prompts(), max_new_tokens=[2, 2])
    for h in hooks:
        h.remove()
    assert seen and set(seen[0::2]) == {torch.float32} and set(seen[1::2]) == {torch.bfloat16}


def test_other_families_keep_their_layers(fused_cpu):
    llama = tiny("llama")
    with GraphModel(llama, backend=fused_cpu, **LIMITS) as gm:
        assert not gm.fused
        assert not any("forward" in layer.__dict__ for layer in llama.model.layers)
    qwen = tiny("qwen3")  # a layer the fused epilogue cannot express (one eps for q and k)
    qwen.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3
    with GraphModel(qwen, backend=fused_cpu, **LIMITS) as gm:
        assert not gm.fused


def test_the_fused_form_is_asked_for(fused_cpu, monkeypatch):
    qwen = tiny("qwen3")
    with GraphModel(qwen, backend=fused_cpu, fuse_layers=False, **LIMITS) as gm:
        assert not gm.fused
    monkeypatch.delenv("XGRAPH_FUSE_LAYERS")  # on by default where there is a fused kernel
    with GraphModel(qwen, backend=fused_cpu, **LIMITS) as gm:
        assert gm.fused
    monkeypatch.setenv("XGRAPH_FUSE_LAYERS", "0")
    with GraphModel(qwen, backend=fused_cpu, **LIMITS) as gm:
        assert not gm.fused
    with GraphModel(qwen, backend=fused_cpu, fuse_layers=True, **LIMITS) as gm:
        assert gm.fused
    monkeypatch.setenv("XGRAPH_FUSE_LAYERS", "maybe")
    with pytest.raises(xgraph.XGraphError, match="XGRAPH_FUSE_LAYERS"):
        GraphModel(qwen, backend=fused_cpu, **LIMITS)


def test_fused_layers_that_change_the_logits_are_not_kept(fused_cpu, monkeypatch, caplog):
    from xgraph.integrations.transformers import fusions

    forward = fusions._forward

    def skewed(layer, hidden_states, *args, **kwargs):  # type: ignore[no-untyped-def]
        return forward(layer, hidden_states, *args, **kwargs) * 1.5

    monkeypatch.setattr(fusions, "_forward", skewed)
    qwen = tiny("qwen3")
    with GraphModel(qwen, backend=fused_cpu, **LIMITS) as gm:
        assert not gm.fused
        assert not any("forward" in layer.__dict__ for layer in qwen.model.layers)
    assert "fused Qwen3 layers were not kept" in caplog.text


def test_a_backend_without_a_fused_kernel_keeps_the_layers():
    qwen = tiny("qwen3")
    with GraphModel(qwen, backend="cpu", **LIMITS) as gm:  # the CPU backend as it is
        assert not gm.fused
        assert not any("forward" in layer.__dict__ for layer in qwen.model.layers)


def test_a_fused_layer_outside_its_forward_says_what_to_do(fused_cpu):
    model = tiny("qwen3")
    from xgraph.integrations.transformers.linears import swap_linears

    swap_linears(model, merge=True)
    assert fuse_layers(model)
    layer = model.model.layers[0]
    h = torch.zeros(1, 3, 64)
    cos = sin = torch.zeros(1, 3, 16)
    with pytest.raises(xgraph.XGraphError, match="unfuse_layers"):
        layer(h, position_embeddings=(cos, sin))


def test_the_rotary_table_rotates_as_transformers_does():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from xgraph.fusion import apply_rotary

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 16, generator=g)  # [1, heads, tokens, dim]
    ang = torch.randn(1, 5, 8, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    got = apply_rotary(q[0].transpose(0, 1), table(cos, sin))  # [tokens, heads, dim]
    torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_the_compile_cache_keys_the_fused_layers_apart(fused_cpu, tmp_path):
    keys = []
    for fuse in (False, True):
        qwen = tiny("qwen3")
        kw = dict(compile="inductor", compile_cache=tmp_path, fuse_layers=fuse)
        kw["compile_scope"] = "forward"
        with GraphModel(qwen, backend=fused_cpu, **kw, **LIMITS) as gm:  # no step: no compile
            assert gm.fused is fuse
            keys.append(gm.compiled.cache.key)
    assert keys[0] != keys[1]  # a forward traced one way is never loaded for the other


def test_the_fused_modules_survive_a_pickle_round_trip(fused_cpu):
    """torch's ahead-of-time compile snapshots the modules its guards read by pickling them
    by value (a warm process unpickles them to load the compiled forward): a fused layer
    and the rotary module come back fused, the rotary computing the same table. A bound
    method kept in a module failed here (an AttributeError on the half-restored module)."""
    from xgraph.integrations.transformers import fusions

    qwen = tiny("qwen3")
    with GraphModel(qwen, backend=fused_cpu, **LIMITS) as gm:
        assert gm.fused
        layer, rotary = qwen.model.layers[0], qwen.model.rotary_emb
        copy_layer, copy_rotary = pickle.loads(pickle.dumps((layer, rotary)))
        assert copy_layer.forward.func is fusions._forward
        assert copy_layer.forward.args == (copy_layer,)
        assert copy_rotary.forward.args == (copy_rotary,)
        x, pos = torch.randn(1, 3, qwen.config.hidden_size), torch.arange(3)[None]
        got, want = copy_rotary(x, pos), rotary(x, pos)
        assert got[1] == want[1] == fusions.TABLE
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


def test_a_later_graph_model_loads_the_fused_forward_compiled_ahead(fused_cpu, tmp_path):
    """Through the compile cache, a second GraphModel over a fresh fused model loads both
    token classes' forwards compiled ahead of time (nothing compiled, nothing ignored) and
    gives the first one's tokens."""
    got = []
    for _ in range(2):
        qwen = tiny("qwen3")
        kw = dict(compile="inductor", compile_cache=tmp_path, compile_scope="forward")
        with GraphModel(qwen, backend=fused_cpu, **kw, **LIMITS) as gm:
            assert gm.fused
            got.append(gm.generate([[1, 2, 3, 4]], max_new_tokens=3).tokens)
            stats = gm.compiled.stats()
    assert got[0] == got[1]
    assert stats["cache"]["ignored"] is None
    assert stats["ahead"]["loaded"] == ["many", "one"] and stats["ahead"]["compiled"] == []


def test_the_auto_scope_leaves_fused_layers_uncompiled_and_the_default_compiles_them(
    fused_cpu, monkeypatch
):
    """compile=True over fused layers under compile_scope="auto": nothing compiled, the stats
    say why, the tokens those of compile=False; the default scope compiles the same model's
    forward whole, and "auto" over the model's own layers does too."""
    from xgraph.compiled import TokenCompiled
    from xgraph.integrations.transformers.compiling import FUSED

    monkeypatch.delenv("XGRAPH_COMPILE_SCOPE", raising=False)
    ps, tokens = _prompts(), []
    for compile in (False, "aot_eager"):
        kw = dict(compile=compile, compile_scope="auto")
        with GraphModel(tiny("qwen3"), backend=fused_cpu, **kw, **LIMITS) as gm:
            assert gm.fused and gm.compiled is None
            tokens.append(gm.generate(ps, max_new_tokens=NEW).tokens)
            stats = gm.stats()["compile"]
            assert stats == ({"skipped": FUSED} if compile else None)
    assert tokens[0] == tokens[1]
    with GraphModel(tiny("qwen3"), backend=fused_cpu, compile="aot_eager", **LIMITS) as gm:
        assert gm.fused and isinstance(gm.compiled, TokenCompiled)  # the default: compiled
        assert gm.generate(ps, max_new_tokens=NEW).tokens == tokens[0]
    own = dict(compile="aot_eager", fuse_layers=False, compile_scope="auto")
    with GraphModel(tiny("qwen3"), backend=fused_cpu, **own, **LIMITS) as gm:
        assert not gm.fused and isinstance(gm.compiled, TokenCompiled)  # the whole forward
