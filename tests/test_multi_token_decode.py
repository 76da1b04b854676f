"""Uniform multi-token decode (speculative verification): steps where every sequence adds
the same q tokens run as full graphs keyed by (padded tokens, q), several q side by side,
equal to the same step run eagerly (bitwise, CPU) and close to the prefill runner's."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import xgraph
from xgraph.models import Step, Workload
from xgraph.runners import PagedDecodeRunner, PagedPrefillRunner

BUCKETS = [1, 2, 4, 8, 16, 32]


def workloads(n: int = 3) -> list[Workload]:
    out = [Workload.tiny(num_blocks=160, max_blocks=8, max_seqs=32) for _ in range(n)]
    for w in out:
        w.randomize_cache(11)
    return out


def verify_step(w: Workload, rng: random.Random, q: int, n: int) -> Step:
    """n sequences each verifying q - 1 draft tokens (q new tokens), contexts of any length."""
    return w.step(rng, [q] * n, [rng.randint(q, w.max_blocks * w.block_size) for _ in range(n)])


def padded(w: Workload, step: Step, q: int) -> Step:
    """The step as a full graph of query length q sees it: sequences padded to a bucket,
    each padded sequence q tokens at the dummy block."""
    n = len(step.attn.query_lens)
    sb = xgraph.Buckets(BUCKETS).pad(n)
    tb = sb * q
    a = step.attn.padded(sb, tb, w.cache.dummy_slot, w.cache.dummy_block, w.max_blocks, q)
    pad = torch.zeros(tb - step.num_tokens, dtype=torch.int64)
    return Step(torch.cat([step.input_ids, pad]), torch.cat([step.positions, pad]), a)


def key(q: int, n: int) -> tuple:
    sb = xgraph.Buckets(BUCKETS).pad(n)
    return ("full", sb * q, q) if q > 1 else ("full", sb)


def test_verification_steps_run_as_full_graphs_equal_to_eager():
    ex_w, ref_w, pre_w = workloads()
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, attention=ex_w.attention(max_query_len=8))
    rng = random.Random(0)
    plan = [(2, 3), (3, 5), (4, 2), (5, 3), (3, 4), (2, 1), (1, 6), (5, 2), (3, 8)]
    for q, n in plan:
        step = verify_step(ex_w, rng, q, n)
        out = ex(**step.kwargs())
        ref = ref_w.eager(padded(ref_w, step, q), runner=PagedDecodeRunner())
        assert torch.equal(out, ref[: step.num_tokens]), (q, n)
        for a, b in zip(ex_w.cache.tensors(), ref_w.cache.tensors()):
            assert torch.equal(a, b)
        # the prefill runner plans each sequence's causal mask on the host: same attention
        pre = pre_w.eager(step, runner=PagedPrefillRunner())
        torch.testing.assert_close(out, pre, rtol=1e-4, atol=1e-4)
        for t, r in zip(pre_w.cache.tensors(), ref_w.cache.tensors()):
            t.copy_(r)  # its cache drifts by rounding: the next step starts from the same
    steps = Counter(key(q, n) for q, n in plan)
    s = ex.stats()
    assert s["eager"] == {} and s["hits"] == {k: c - 1 for k, c in steps.items()}
    ex.close()


def test_several_query_lengths_share_one_executor_and_count_their_replays():
    ex_w, ref_w, _ = workloads()
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, attention=ex_w.attention(max_query_len=8))
    rng = random.Random(1)
    for _ in range(3):
        for q in (2, 3, 1):
            step = verify_step(ex_w, rng, q, 3)
            out = ex(**step.kwargs())
            ref = ref_w.eager(padded(ref_w, step, q), runner=PagedDecodeRunner())
            assert torch.equal(out, ref[: step.num_tokens])
    s = ex.stats()
    assert s["hits"] == {("full", 8, 2): 2, ("full", 12, 3): 2, ("full", 4): 2}
    assert s["captures"] == 3 and s["replays"] == 9
    ex.close()


def test_verification_graphs_are_captured_ahead():
    w = workloads(1)[0]
    ex = w.executor(backend="cpu", buckets=BUCKETS, attention=w.attention(max_query_len=8))
    before = [t.clone() for t in w.cache.real()]
    ex.capture([4, 2], query_len=3, progress=False)
    assert ex.stats()["keys"] == [("full", 12, 3), ("full", 6, 3)]
    for a, b in zip(before, w.cache.real()):
        assert torch.equal(a, b)  # the synthetic steps touched only the dummy block
    ex(**verify_step(w, random.Random(2), 3, 4).kwargs())
    assert ex.stats()["hits"][("full", 12, 3)] == 1
    ex.capture(query_len=5, progress=False)  # every bucket whose sequences times 5 fit
    assert {k for k in ex.stats()["keys"] if k[-1] == 5} == {("full", 5 * s, 5) for s in (1, 2, 4)}
    with pytest.raises(xgraph.XGraphError, match="query_len=9"):
        ex.capture([1], query_len=9, progress=False)
    ex.close()


class SingleTokenRunner(PagedDecodeRunner):
    max_query_len = 1  # a decode runner that serves one token per sequence only


def test_without_max_query_len_or_past_it_verification_runs_piecewise():
    w = workloads(1)[0]
    rng = random.Random(3)
    ex = w.executor(backend="cpu", buckets=BUCKETS)  # max_query_len=1: decode only
    ex(**verify_step(w, rng, 3, 2).kwargs())
    ex(**verify_step(w, rng, 9, 2).kwargs())
    assert ex.stats()["keys"] == [("piecewise", 32), ("piecewise", 8)]
    ex.close()
    ex = w.executor(backend="cpu", buckets=BUCKETS, attention=w.attention(max_query_len=4))
    ex(**verify_step(w, rng, 5, 2).kwargs())  # past max_query_len
    ex(**verify_step(w, rng, 4, 5).kwargs())  # 8 sequences x 4 = 32: fits
    ex(**verify_step(w, rng, 3, 9).kwargs())  # 16 sequences x 3 > 32: no full graph fits
    assert ex.stats()["keys"] == [("full", 32, 4), ("piecewise", 16), ("piecewise", 32)]
    ex.close()
    ex = w.executor(
        backend="cpu",
        buckets=BUCKETS,
        mode="full",
        on_overflow="raise",
        attention=w.attention(max_query_len=4),
    )
    with pytest.raises(xgraph.BucketOverflowError, match="9 sequences of 3 tokens"):
        ex(**verify_step(w, rng, 3, 9).kwargs())
    ex.close()


def test_a_decode_runner_that_serves_fewer_tokens_is_refused_at_construction():
    w = workloads(1)[0]
    with pytest.raises(xgraph.XGraphError, match="serves full graphs of up to 1 tokens"):
        w.executor(
            backend="cpu",
            attention=w.attention(decode_runner=SingleTokenRunner(), max_query_len=3),
        )
    with pytest.raises(xgraph.XGraphError, match="max_query_len=0"):
        w.attention(max_query_len=0)
