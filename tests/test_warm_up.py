"""GraphExecutor.warm_up: the synthetic steps run eagerly, nothing recorded, nothing but the
dummy block written; captures and steps afterwards are unchanged."""

from __future__ import annotations

import random

import pytest
import torch

import xgraph
from xgraph.bench.report import workload


@pytest.fixture
def w():
    return workload(xgraph.get_backend("cpu"), "tiny", max_seqs=8, context=64)


def _cache_but_dummy(w) -> list[torch.Tensor]:
    d = w.cache.dummy_block
    return [torch.cat([t[:d], t[d + 1 :]]).clone() for t in w.cache.tensors()]


@pytest.mark.parametrize("kind", ["full", "piecewise"])
def test_warm_up_records_nothing_and_writes_only_the_dummy_block(w, kind):
    w.randomize_cache(1)
    before = _cache_but_dummy(w)
    with w.executor(backend="cpu", buckets=[1, 2, 4, 8]) as ex:
        ex.warm_up([8, 1, 4], kind=kind)
        s = ex.stats()
        assert s["captures"] == 0 and s["keys"] == []
        assert s["eager"] == {"warm-up": 3}
        assert s["graph_bytes"] == 0
    for a, b in zip(before, _cache_but_dummy(w)):
        assert torch.equal(a, b)


def test_steps_after_a_warm_up_equal_eager_bitwise(w):
    step = w.decode_step(random.Random(0), 4, max_context=48)  # a bucket: no padding
    with w.executor(backend="cpu", buckets=[1, 2, 4, 8]) as ex:
        ex.warm_up()  # every bucket, like capture()
        got = ex(**step.kwargs())
        assert ex.stats()["captures"] == 1
    with w.executor(backend="cpu", buckets=[1, 2, 4, 8], mode="eager") as eager:
        want = eager(**step.kwargs())
    assert torch.equal(got, want)


def test_warm_up_asks_for_a_layout(w):
    with w.executor(backend="cpu", buckets=[1, 2]) as ex:
        with pytest.raises(xgraph.XGraphError, match="choose the layout, 'full' or 'piecewise'"):
            ex.warm_up(kind="eager")
