"""Several decode steps per launch through a Hugging Face model (GraphModel's engine): the
same greedy and seeded tokens for K = 1, 2, 8, with requests of different lengths, stop
tokens, and a request arriving while others decode."""

from __future__ import annotations

import random

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, TINY, tiny  # noqa: E402

from xgraph.integrations.transformers import GraphModel, SamplingParams  # noqa: E402

LENS = (7, 3, 12)
NEW = [9, 5, 12]


def _prompts(seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in LENS]


@pytest.fixture(scope="module")
def gm():
    with GraphModel(tiny("qwen3", seed=2), backend="cpu", **LIMITS) as g:
        yield g


@pytest.mark.parametrize("k", [2, 8])
def test_multi_step_greedy_and_seeded_tokens_equal_one_step_at_a_time(gm, k):
    ps = _prompts()
    hot = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=11)
    for sampling in (None, hot):
        want = gm.generate(ps, NEW, sampling=sampling)
        got = gm.generate(ps, NEW, sampling=sampling, steps_per_launch=k)
        assert got.tokens == want.tokens
        assert got.finish_reasons == want.finish_reasons
        assert got.decode_tokens == want.decode_tokens
    stats = gm.decode_loop(k).stats()
    assert set(stats) == {"greedy", "sample"}
    assert all(s["replays"] > 0 and not s["eager"] for s in stats.values())  # graphs ran


def test_multi_step_stops_at_a_stop_token_and_admits_between_launches(gm):
    ps = _prompts(5)
    free = gm.generate(ps, NEW).tokens
    stop = free[0][2]  # the third token of the first request ends it
    engine = gm.engine(steps_per_launch=8, eos_token_id=stop)
    one = gm.engine(eos_token_id=stop)
    for e in (engine, one):
        for p, n in zip(ps[:2], NEW[:2]):
            e.add(p, n)
    first = engine.step()  # the prefill step, one at a time
    assert len(first) == 2
    late = engine.step()  # a launch of 8 decode steps
    assert max(sum(1 for ev in late if ev.index == i) for i in range(2)) > 1
    engine.add(ps[2], NEW[2])  # joins between launches
    one.add(ps[2], NEW[2])
    got = engine.run().tokens
    want = one.run().tokens
    assert got == want
    assert got[0] == free[0][: free[0].index(stop) + 1]  # ended at its stop token
