"""A compiled executor's forward launches first at the smallest bucket (xgraph.tuning)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from xgraph.models import Qwen3Config, Qwen3Model, Workload
from xgraph.tuning import tuning_size

BUCKETS = [1, 2, 4, 8, 16, 32]


def workload() -> Workload:
    c = dataclasses.replace(Qwen3Config.tiny(), num_layers=2)
    w = Workload(Qwen3Model.build(c, num_blocks=37, block_size=4, seed=1), 8, 32)
    w.randomize_cache(3)
    return w


def recorded(w: Workload, sizes: list[int]):  # type: ignore[no-untyped-def]
    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        sizes.append(input_ids.shape[0])
        return w.model.forward_logits(input_ids, positions)

    return forward


def _cache(w: Workload) -> list[torch.Tensor]:
    keep = [b for b in range(w.cache.num_blocks + 1) if b != w.cache.dummy_block]
    return [t[keep].clone() for t in w.cache.tensors()]


@pytest.mark.parametrize("compiled", [True, False])
def test_the_first_launch_is_at_the_smallest_bucket_of_two_or_more(compiled):
    w, sizes = workload(), []
    before = _cache(w)
    ex = w.executor(recorded(w, sizes), backend="cpu", buckets=BUCKETS, compiled=compiled)
    ex.capture([32, 8], kind="full", progress=False)
    # warm-up and recording of each capture; compiled: the 2-token launch before them
    assert sizes == ([2] if compiled else []) + [32, 32, 8, 8]
    assert all(torch.equal(a, b) for a, b in zip(before, _cache(w)))  # dummy block only
    step = w.decode_step(random.Random(5), 7)
    plain = w.executor(backend="cpu", buckets=BUCKETS)
    assert torch.equal(ex(**step.kwargs()), plain(**step.kwargs()))
    assert ex.stats()["captures"] == 2 and ex.stats()["eager"] == {}  # the launch: neither
    ex.close()
    plain.close()


@pytest.mark.parametrize(("buckets", "first"), [([1, 2, 4], 2), ([1], 1), ([4, 8], 4)])
def test_no_second_launch_when_the_first_is_at_that_size_or_there_is_none(buckets, first):
    w, sizes = workload(), []
    ex = w.executor(recorded(w, sizes), backend="cpu", buckets=buckets, compiled=True)
    ex.capture([first], kind="full", progress=False)
    assert sizes == [first, first]
    ex.close()


def test_tuning_size():
    assert tuning_size([32, 1, 4, 2]) == 2
    assert tuning_size([1]) is None
    assert tuning_size([16, 8]) == 8
