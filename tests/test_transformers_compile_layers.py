"""GraphModel(compile=..., compile_scope="layers"): one decoder layer compiled, its code run by
every layer (xgraph.compiled_layers).

On the CPU backend the compiler backend is "aot_eager" (as test_transformers_compile.py's).
What must hold:
- greedy tokens identical to transformers' generate (three families of hf_tiny.py), under
  graphs and with every step through the compiled layers;
- the compiles do not grow with the layers: a model of six layers compiles as many graphs as
  one of two (the attention calls leave the graph; nothing is guarded per layer);
- the layers run compiled only inside the GraphModel's forward, and `close()` gives them
  their own forwards back;
- a scope that is not one, "layers" with a compile per token count, or "layers" on a model
  without a `layers` list, is refused before anything is built.
"""

from __future__ import annotations

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, tiny  # noqa: E402

# fresh_dynamo: its autouse fixture (Dynamo reset and its counters cleared around each test)
from test_transformers_compile import fresh_dynamo, hf_greedy, prompts  # noqa: E402, F401

from xgraph.compiled_layers import LayerCompiled  # noqa: E402
from xgraph.errors import XGraphError  # noqa: E402
from xgraph.integrations.transformers import GraphModel  # noqa: E402

NEW = 6
COMPILER = "aot_eager"


def layered(model: torch.nn.Module, **kwargs: object) -> GraphModel:
    return GraphModel(
        model, backend="cpu", compile=COMPILER, compile_scope="layers", **LIMITS, **kwargs
    )


# llama's layers are qwen3's without the QK-norm; mistral's pass the attention a sliding
# window; test_transformers_compile.py runs every family
@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma"])
def test_greedy_tokens_equal_transformers_generate_with_compiled_layers(family):
    model = tiny(family)
    ps = prompts()
    want = hf_greedy(model, ps, NEW)
    with layered(model, on_capture_error="raise") as gm:
        got = gm.generate(ps, NEW)
        stats = gm.stats()["compile"]
    assert got.tokens == want
    assert got.graph_steps["eager"] == 0 and got.graph_steps["full"] > 0
    assert stats["scope"] == "layers" and stats["fallback"] is None
    assert stats["compiles"] > 0 and 1 in stats["sizes"]


def test_every_step_through_the_compiled_layers_gives_transformers_tokens():
    model = tiny("qwen3", seed=1)
    ps = prompts(2)
    want = hf_greedy(model, ps, NEW)
    with layered(model, mode="eager") as gm:
        result = gm.generate(ps, NEW)
        stats = gm.stats()["compile"]
    assert result.tokens == want
    assert result.graph_steps["eager"] == result.steps
    assert len(stats["sizes"]) >= 5


def _compiles(layers: int) -> tuple[int, list[list[int]]]:
    model = tiny("qwen3", seed=2, num_hidden_layers=layers)
    torch._dynamo.reset()
    with layered(model, mode="eager") as gm:
        tokens = gm.generate(prompts(3), NEW).tokens
        return gm.stats()["compile"]["compiles"], tokens


def test_the_compiles_do_not_grow_with_the_layers():
    """Six layers compile exactly the graphs two do (a guard per layer would recompile for
    each, and past Dynamo's recompile limit run the layers uncompiled)."""
    two, _ = _compiles(2)
    six, _ = _compiles(6)
    assert two == six
    # the layer's pieces around the attention (and the attention call's own few ops up to
    # the break), for one token and for two or more, and a few for other strides of q
    assert 0 < six <= 16


def test_layers_run_compiled_only_inside_the_forward_and_get_their_forwards_back():
    model = tiny("qwen3", seed=3)
    layers = list(model.model.layers)
    before = [m.__dict__.get("forward") for m in layers]
    gm = layered(model)
    assert isinstance(gm.compiled, LayerCompiled)
    compiles = gm.compiled.compiles
    with torch.no_grad():  # the model called directly: the layers as they are
        model.set_attn_implementation("sdpa")
        model(torch.tensor([[1, 2, 3]]))
        model.set_attn_implementation("xgraph")
    assert gm.compiled.compiles == compiles
    gm.generate(prompts(4, (5,)), 2)
    assert gm.compiled.compiles > compiles
    gm.close()
    assert [m.__dict__.get("forward") for m in layers] == before


def test_an_unknown_scope_and_a_model_without_layers_are_refused():
    model = tiny("qwen3", seed=4)
    with pytest.raises(XGraphError, match="compile_scope='whole'"):
        GraphModel(model, backend="cpu", compile=COMPILER, compile_scope="whole", **LIMITS)
    with pytest.raises(XGraphError, match="compile_dynamic=True"):
        layered(model, compile_dynamic=False)
    layers = model.model.layers
    del model.model.layers
    try:
        with pytest.raises(XGraphError, match="needs the decoder's layers"):
            layered(model)
    finally:
        model.model.layers = layers
    with layered(model) as gm:  # refused before anything was built: the model is usable
        assert gm.generate(prompts(5, (4,)), 2).tokens


def test_the_scope_comes_from_the_environment_when_not_given(monkeypatch):
    model = tiny("qwen3", seed=6)
    monkeypatch.setenv("XGRAPH_COMPILE_SCOPE", "layers")
    with GraphModel(model, backend="cpu", compile=COMPILER, **LIMITS) as gm:
        assert isinstance(gm.compiled, LayerCompiled)
    with GraphModel(
        model, backend="cpu", compile=COMPILER, compile_scope="forward", **LIMITS
    ) as gm:
        assert gm.stats()["compile"].get("scope") is None  # the whole forward: TokenCompiled
    monkeypatch.setenv("XGRAPH_COMPILE_SCOPE", "whole")
    with pytest.raises(XGraphError, match="XGRAPH_COMPILE_SCOPE='whole'"):
        GraphModel(model, backend="cpu", compile=COMPILER, **LIMITS)


def test_several_steps_a_launch_over_compiled_layers_give_one_step_a_launch_tokens():
    model = tiny("qwen3", seed=7)
    ps = prompts(8, (6, 11))
    with layered(model) as gm:
        want = gm.generate(ps, NEW)
        got = gm.generate(ps, NEW, steps_per_launch=3)
        stats = gm.stats()["compile"]
    assert got.tokens == want.tokens == hf_greedy(model, ps, NEW)
    assert stats["fallback"] is None


def test_compiled_layers_under_inference_mode_and_from_another_thread():
    """What engines do: steps under torch.inference_mode(), and from a thread of their own
    (the layers run compiled in whichever thread calls the forward)."""
    model = tiny("qwen3", seed=9)
    ps = prompts(9, (5, 8))
    with layered(model) as gm:
        want = gm.generate(ps, 4).tokens
        with torch.inference_mode():
            assert gm.generate(ps, 4).tokens == want
        got: dict[str, object] = {}
        t = threading.Thread(target=lambda: got.setdefault("tokens", gm.generate(ps, 4).tokens))
        t.start()
        t.join(120)
        assert not t.is_alive() and got["tokens"] == want
        assert gm.stats()["compile"]["fallback"] is None
