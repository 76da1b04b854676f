"""GraphModel(compile=True): transformers' decoder torch.compile'd inside xgraph's graphs.

On the CPU backend the compiler backend is "aot_eager" (Inductor needs a C++ toolchain and
minutes; on a GPU it is the default). What must hold, for the four families of
hf_tiny.py (those of test_transformers.py):
- greedy tokens identical to transformers' own generate(), with and without compile=True;
- one compile for every bucket: a graph for every token count of 2 or more and one for a
  single token, whatever the sizes, with no graph break (torch._dynamo's counters);
- the compiled code itself runs the steps (mode="eager" runs every step through it) and
  calls the attention custom op, whose cache arguments are the cache tensors themselves;
- sampled tokens are reproducible with a seed; logits only for the rows that sample.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import FAMILIES, LIMITS, TINY, tiny  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from xgraph.integrations.transformers import GraphModel, SamplingParams  # noqa: E402

PROMPT_LENS = (13, 5, 29, 9, 3)  # five over four seats; 29 > 16: chunked
NEW = 6
COMPILER = "aot_eager"


def prompts(seed: int = 0, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in lens]


def hf_greedy(model: torch.nn.Module, ps: list[list[int]], new: int) -> list[list[int]]:
    """transformers' own greedy generate(), one prompt at a time (no padding: the mask is
    given, or generate would take every token equal to pad_token_id for padding)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    out = []
    for p in ps:
        with torch.no_grad():
            ids = ref.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers_generate_with_and_without_compile(family):
    model = tiny(family)
    ps = prompts()
    want = hf_greedy(model, ps, NEW)
    with GraphModel(model, backend="cpu", on_capture_error="raise", **LIMITS) as gm:
        plain = gm.generate(ps, NEW)
    with GraphModel(
        model, backend="cpu", compile=COMPILER, on_capture_error="raise", **LIMITS
    ) as gm:
        compiled = gm.generate(ps, NEW)
        stats = gm.stats()
    assert plain.tokens == want
    assert compiled.tokens == want
    assert compiled.graph_steps["eager"] == 0 and compiled.graph_steps["full"] > 0
    assert stats["compile"]["fallback"] is None and stats["compile"]["fullgraph"]
    assert stats["head"] == "outside the graphs"


@pytest.mark.parametrize("family", ["qwen3", "gemma"])
def test_every_step_through_the_compiled_code_gives_transformers_tokens(family):
    """mode="eager": no graph records anything, every step runs the compiled decoder, at
    every token count the steps have (chunks, mixed steps, shrinking decode batches)."""
    model = tiny(family, seed=1)
    ps = prompts(2)
    want = hf_greedy(model, ps, NEW)
    with GraphModel(model, backend="cpu", compile=COMPILER, mode="eager", **LIMITS) as gm:
        result = gm.generate(ps, NEW)
        stats = gm.stats()["compile"]
    assert result.tokens == want
    assert result.graph_steps["eager"] == result.steps
    assert len(stats["sizes"]) >= 5 and 1 in stats["sizes"]  # many sizes, one compile each kind
    assert stats["compiles"] == 2  # one graph for 2..16 tokens, one for a single token
    assert dict(counters["graph_break"]) == {}


def test_one_compile_serves_every_bucket_without_a_graph_break():
    model = tiny("llama", seed=2)
    with GraphModel(
        model,
        backend="cpu",
        compile=COMPILER,
        buckets=[1, 2, 3, 4, 8, 12, 16],
        on_capture_error="raise",
        **LIMITS,
    ) as gm:
        gm.capture()  # warm-ups run the compiled decoder at every bucket
        stats = gm.stats()
        assert stats["compile"]["compiles"] == 2
        assert stats["compile"]["sizes"] == [1, 2, 3, 4, 8, 12, 16]
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 2
        result = gm.generate(prompts(3), NEW)  # and the steps after it compile nothing
        assert gm.stats()["compile"]["compiles"] == 2
        assert result.graph_steps["eager"] == 0


def test_compiled_decoder_calls_the_attention_op_on_the_cache_itself():
    """The graph Dynamo hands the compiler holds xgraph::attention once per attention call,
    with the cache tensors as graph inputs (no copy of the cache in the graph)."""
    graphs = []

    def keep(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append((gm, example_inputs))
        return gm.forward

    model = tiny("qwen3", seed=3)
    with GraphModel(model, backend="cpu", compile=keep, mode="eager", **LIMITS) as gm:
        gm.generate(prompts(4, (7,)), 2)
        cache = {t.data_ptr() for t in gm.cache.tensors()}
    op = torch.ops.xgraph.attention.default
    for g, inputs in graphs:
        calls = [n for n in g.graph.nodes if n.target is op]
        assert len(calls) == TINY["num_hidden_layers"]
        placeholders = {n.name: x for n, x in zip(g.graph.find_nodes(op="placeholder"), inputs)}
        for n in calls:
            k_cache, v_cache = n.args[3], n.args[4]
            for arg in (k_cache, v_cache):
                assert arg.op == "placeholder", arg  # the graph's input, not a copy
                assert placeholders[arg.name].data_ptr() in cache


def test_sampled_tokens_are_reproducible_with_a_seed():
    model = tiny("qwen3", seed=4)
    ps = prompts(5, (7, 11, 4))
    hot = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=11)
    with GraphModel(model, backend="cpu", compile=COMPILER, **LIMITS) as gm:
        a = gm.generate(ps, 8, sampling=hot).tokens
        b = gm.generate(ps, 8, sampling=hot).tokens
        other = gm.generate(ps, 8, sampling=SamplingParams(temperature=1.5, seed=12)).tokens
    assert a == b and a != other
    with GraphModel(model, backend="cpu", **LIMITS) as gm:  # the same draws uncompiled
        assert gm.generate(ps, 8, sampling=hot).tokens == a


def test_a_graph_break_falls_back_to_compiling_with_breaks_and_says_so():
    """A model that cannot compile as one graph still runs, compiled in parts, with a
    warning naming why, and gives the same tokens."""
    model = tiny("llama", seed=5)
    ps = prompts(6, (6, 9))
    want = hf_greedy(model, ps, 4)
    mlp = model.model.layers[0].mlp
    forward = mlp.forward

    def breaking(x):  # type: ignore[no-untyped-def]
        torch._dynamo.graph_break()
        return forward(x)

    mlp.forward = breaking
    with (
        pytest.warns(UserWarning, match="does not compile as one graph"),
        GraphModel(model, backend="cpu", compile=COMPILER, mode="eager", **LIMITS) as gm,
    ):
        result = gm.generate(ps, 4)
        stats = gm.stats()["compile"]
    assert result.tokens == want
    assert stats["graph_breaks"] and not stats["fullgraph"] and stats["fallback"] is None
