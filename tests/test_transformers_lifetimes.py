"""GraphModel lifetimes: several over one model object, and one dropped without close().

Closing one GraphModel never changes what another one over the same model computes (the
switch to the "xgraph" attention is counted per model object), and a GraphModel nobody
closed is closed when it is collected: executor first, then the model's attention, its
cache freed with it, and a failure there reported, never raised.
"""

from __future__ import annotations

import copy
import gc
import logging
import random
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, TINY, tiny  # noqa: E402

from xgraph.integrations.transformers import GraphModel  # noqa: E402


def prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in lens]


def holders(model: torch.nn.Module) -> int:
    from xgraph.integrations.transformers.registration import holders

    return holders(model)


def greedy_reference(ref: torch.nn.Module, ps: list[list[int]], new: int) -> list[list[int]]:
    """transformers' own greedy continuation, one full forward per token."""
    out = []
    for p in ps:
        seq = list(p)
        with torch.no_grad():
            for _ in range(new):
                seq.append(int(ref(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(p) :])
    return out


def test_closing_one_graphmodel_leaves_another_over_the_same_model_intact():
    model = tiny("llama")
    ref = copy.deepcopy(model)
    first = GraphModel(model, backend="cpu", **LIMITS)
    second = GraphModel(model, backend="cpu", **LIMITS)
    assert holders(model) == 2
    early = prompts(0, (5,))
    assert first.generate(early, 3).tokens == greedy_reference(ref, early, 3)
    first.close()
    assert model.config._attn_implementation == "xgraph"  # the second still holds it
    # three sequences, longer prompts: buckets the second captures only after the close
    late = prompts(1, (11, 7, 9))
    result = second.generate(late, 6)
    assert result.tokens == greedy_reference(ref, late, 6)
    assert set(second.stats()["keys"]) >= {("full", 4), ("piecewise", 16)}
    second.close()
    assert model.config._attn_implementation == "sdpa" and holders(model) == 0
    first.close()  # closing twice changes nothing
    assert model.config._attn_implementation == "sdpa"


def test_a_graphmodel_dropped_without_close_is_released_when_collected():
    model = tiny("llama")
    gm = GraphModel(model, backend="cpu", **LIMITS)
    gm.generate(prompts(2, (9, 4)), 4)
    executor = weakref.ref(gm.executor)
    cache = [weakref.ref(t) for t in gm.cache.tensors()]
    del gm
    gc.collect()
    assert executor() is None  # the executor, its graphs and graph memory are gone
    assert all(t() is None for t in cache)  # the KV cache is freed
    assert model.config._attn_implementation == "sdpa"  # the model has its attention back
    assert holders(model) == 0


def test_collection_closes_the_executor_before_giving_the_attention_back():
    model = tiny("llama")
    gm = GraphModel(model, backend="cpu", **LIMITS)
    gm.generate(prompts(3, (6,)), 2)
    executor = gm.executor  # kept: its state after the GraphModel is gone can be read
    seen = []
    close = executor.close

    def recording_close() -> None:
        seen.append(model.config._attn_implementation)  # still "xgraph" when it closes
        close()

    executor.close = recording_close
    del gm
    gc.collect()
    assert seen == ["xgraph"]
    assert executor.closed and model.config._attn_implementation == "sdpa"


def test_a_failing_release_is_reported_and_never_raised(caplog):
    model = tiny("llama")
    gm = GraphModel(model, backend="cpu", name="failing", **LIMITS)
    executor = gm.executor

    def broken_close() -> None:
        raise RuntimeError("device lost")

    executor.close = broken_close
    with caplog.at_level(logging.ERROR, logger="xgraph"):
        gm.close()  # no exception
    assert "failing: closing its executor failed" in caplog.text
    assert model.config._attn_implementation == "sdpa"  # the rest was still released
    type(executor).close(executor)
