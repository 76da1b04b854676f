"""Conformance of several decode steps per launch (xgraph.decode_loop) on the backend."""

from __future__ import annotations

import random

import torch

from xgraph.interfaces import Backend

from .base import BackendTests, tiny_workload


def _batch(w, rng: random.Random, n: int, k: int):  # type: ignore[no-untyped-def]
    """n sequences at random contexts, over disjoint blocks with room for k more tokens."""
    bs = w.block_size
    lens = [rng.randint(1, 3 * bs) for _ in range(n)]
    pool = list(range(w.cache.num_blocks))
    rng.shuffle(pool)
    rows = []
    for kv in lens:
        need = -(-(kv + k) // bs)
        rows.append([pool.pop() for _ in range(need)])
    ids = [rng.randrange(w.vocab) for _ in range(n)]
    return ids, lens, rows


def _step(w, ids, lens, rows):  # type: ignore[no-untyped-def]
    from xgraph import AttentionInputs

    bs = w.block_size
    pos = [kv - 1 for kv in lens]
    slots = [r[p // bs] * bs + p % bs for r, p in zip(rows, pos)]
    return torch.tensor(ids), torch.tensor(pos), AttentionInputs([1] * len(ids), lens, rows, slots)


def _loop(w, backend: Backend, k: int):  # type: ignore[no-untyped-def]
    from xgraph.decode_loop import DecodeLoop

    return DecodeLoop(
        w.model.forward_logits,
        attention=w.attention(),
        steps=k,
        backend=backend,
        buckets=[1, 2, 4],
        inputs=w.inputs(),
    )


class MultiStepTests(BackendTests):
    """K decode steps per launch equal K steps of the executor, greedy (tokens and cache)."""

    def test_multi_step_launch_equals_one_step_at_a_time(self, backend: Backend) -> None:
        k, n = 4, 3
        a_w, b_w = (tiny_workload(backend, num_blocks=96, max_blocks=8) for _ in range(2))
        for w in (a_w, b_w):
            w.randomize_cache(11)
        ids, lens, rows = _batch(a_w, random.Random(5), n, k)
        ex = b_w.executor(backend=backend, buckets=[1, 2, 4])
        want = [[] for _ in range(n)]
        cur, kv = list(ids), list(lens)
        for _ in range(k):  # the reference: one executor step at a time, argmax between
            step_ids, positions, attn = _step(b_w, cur, kv, rows)
            out = ex(input_ids=step_ids, positions=positions, attn=attn)
            cur = out.argmax(-1).tolist()
            for i, t in enumerate(cur):
                want[i].append(t)
            kv = [x + 1 for x in kv]
        loop = _loop(a_w, backend, k)
        got = loop(*_step(a_w, ids, lens, rows), budget=[k] * n)
        assert got.tokens == want
        assert got.reasons == ["length"] * n
        for x, y in zip(a_w.cache.tensors(), b_w.cache.tensors()):
            self.assert_matches(backend, x, y)  # the same keys and values, nothing else
        assert loop.stats()["greedy"]["captures"] == 1
        loop.close()
        ex.close()

    def test_multi_step_chained_launches_equal_one_longer_launch(self, backend: Backend) -> None:
        """Two launches of 2 steps, the second queued behind the first from the state it left
        on the device (Launch.then), give the tokens and the cache of one launch of 4."""
        n = 3
        works = [tiny_workload(backend, num_blocks=96, max_blocks=8) for _ in range(2)]
        for w in works:
            w.randomize_cache(13)
        ids, lens, rows = _batch(works[0], random.Random(6), n, 4)
        loops = [_loop(w, backend, k) for w, k in zip(works, (4, 2))]
        want = loops[0](*_step(works[0], ids, lens, rows), budget=[4] * n)
        first = loops[1].launch(*_step(works[1], ids, lens, rows), budget=[4] * n)
        second = first.then()
        got = [a + b for a, b in zip(first.result().tokens, second.result().tokens)]
        assert got == want.tokens
        assert second.result().reasons == want.reasons == ["length"] * n
        for x, y in zip(works[0].cache.tensors(), works[1].cache.tensors()):
            self.assert_matches(backend, x, y)
        for loop in loops:
            loop.close()
