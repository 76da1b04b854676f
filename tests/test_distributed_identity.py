"""Ranks out of step, or built differently, raise a clear error on every rank; ranks in
step stay bitwise equal to eager over many random steps. TP=2 and DP=2 on gloo, spawned
processes; every test is bounded by run_ranks' deadline and every wait by the Parallel's
timeout (xgraph.distributed.identity, docs/distributed.md)."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
from test_distributed_dp import reference

import xgraph
from xgraph import Buckets, Dim, Input
from xgraph.distributed.spawn import run_ranks
from xgraph.models import Workload
from xgraph.models.moe import COMM_DIM, MoEConfig, MoEModel
from xgraph.models.qwen3_tp import Qwen3TPModel

BUCKETS = [1, 2, 4, 8, 16]
TIMEOUT = 20


def tp_pair(group, dtype=torch.float32):
    """The TP model for the executor and the same shard for the eager reference."""
    kw = {"num_blocks": 128, "block_size": 4, "dtype": dtype}
    return [Workload(Qwen3TPModel.build("tiny", group, **kw), 6, 16) for _ in range(2)]


def _error(call) -> tuple[str | None, str, float]:
    t0 = time.monotonic()
    try:
        call()
    except xgraph.XGraphError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


# -- a rank that skips a step ----------------------------------------------------------------


def skip_worker(rank: int, world: int) -> dict:
    ex_w, _ = tp_pair(dist.group.WORLD)
    par = xgraph.Parallel(tp=dist.group.WORLD, timeout=TIMEOUT)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, parallel=par)
    rng = random.Random(4)  # the same batches on both ranks, as a TP group runs
    steps = [ex_w.decode_step(rng, 4) for _ in range(6)]  # one key: the sizes never differ
    ran, err = 0, None
    for i, step in enumerate(steps):
        if rank == 1 and i == 2:
            continue  # rank 1's engine loop drops one call
        err = _error(lambda s=step: ex(**s.kwargs()))
        if err[0] is not None:
            break
        ran += 1
    again = _error(lambda: ex(**steps[-1].kwargs()))[0]
    ex.close()
    return {"ran": ran, "error": err, "again": again}


def misstep_worker(rank: int, world: int) -> dict:
    return {"skip": skip_worker(rank, world), "different": different_worker(rank, world)}


@pytest.fixture(scope="module")
def missteps() -> list[dict]:
    """One spawn for both tests below (process start-up is most of their time)."""
    return [o.value for o in run_ranks(misstep_worker, 2, timeout=300)]


def test_a_rank_that_skips_a_step_raises_on_every_rank_within_the_timeout(missteps):
    for rank, value in enumerate(missteps):
        r = value["skip"]
        assert r["ran"] == 2, (rank, r)  # steps 0 and 1; the next pair is out of step
        name, msg, seconds = r["error"]
        assert name == "OutOfStepError", (rank, r)
        assert issubclass(xgraph.distributed.OutOfStepError, xgraph.distributed.DistributedError)
        assert seconds < TIMEOUT, (rank, seconds)
        assert "form one tensor-parallel group" in msg and "at step #2" in msg, msg
        assert "skipped, repeated or reordered" in msg and "restart the process group" in msg
        assert r["again"] == "DistributedError"  # the executor stays stopped
    assert missteps[0]["skip"]["error"][1] == missteps[1]["skip"]["error"][1]


# -- many random steps in step: bitwise equal to eager ------------------------------------------


def _tp_step(ex_w, rng):
    r = rng.random()
    if r < 0.55:
        return ex_w.decode_step(rng, rng.randint(1, 16)), True
    if r < 0.9:
        query = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        return ex_w.prefill_step(rng, query), False
    query = [rng.randint(6, 8) for _ in range(3)]
    return ex_w.prefill_step(rng, query), False  # above the buckets: eager


def tp_random(steps: int) -> list[tuple]:
    ex_w, ref_w = tp_pair(dist.group.WORLD)
    par = xgraph.Parallel(tp=dist.group.WORLD, timeout=TIMEOUT)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, parallel=par)
    rng, buckets, bad = random.Random(21), Buckets(BUCKETS), []
    for i in range(steps):
        step, full = _tp_step(ex_w, rng)
        out = ex(**step.kwargs()).clone()
        if step.num_tokens > buckets.max:
            ref = ref_w.eager(step)
        else:
            ref = ref_w.eager(ref_w.padded(step, buckets, full=full))[: step.num_tokens]
        if not torch.equal(out, ref):
            bad.append((i, step.num_tokens, float((out - ref).abs().max())))
    ex.close()
    return bad


def dp_random(rank: int, steps: int) -> list[tuple]:
    group = dist.group.WORLD
    c = MoEConfig.tiny()
    ex_w, ref_w = (Workload(MoEModel.build(c, group, num_blocks=128), 6, 16) for _ in range(2))
    par = xgraph.Parallel(dp=group, ep=group, comm_dims=[COMM_DIM], timeout=TIMEOUT)
    dims = [Dim(COMM_DIM, max(BUCKETS), buckets=[4, 16])]
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, dims=dims, parallel=par)
    rng, bad = random.Random(100 + rank), []  # each rank its own batches
    for i in range(steps):
        before, step, r = ex.stats()["hits"], None, rng.random()
        if r < 0.2:
            ex.idle_step()
        else:
            n = rng.randint(1, 16)
            q = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
            step = ex_w.decode_step(rng, n) if r < 0.7 else ex_w.prefill_step(rng, q)
            out = ex(**step.kwargs()).clone()
        st = ex.stats()
        ran = [k for k, h in st["hits"].items() if k not in before or h > before[k]]
        if not ran:  # every rank idle: nothing ran, and no rank runs the reference
            continue
        kind, tokens, comm = ran[0]
        ref = reference(ex, ref_w, step, kind, tokens, comm)  # collective, as the step is
        if step is not None and not torch.equal(out, ref):
            bad.append((i, ran[0]))
    ex.close()
    return bad


def random_worker(rank: int, world: int, steps: int) -> dict:
    return {"tp": tp_random(steps), "dp": dp_random(rank, steps)}


def test_random_tp_and_dp_steps_in_step_stay_bitwise_equal_to_eager():
    for o in run_ranks(random_worker, 2, args=(100,), timeout=600):  # 100 TP + 100 DP steps
        assert o.value == {"tp": [], "dp": []}, (o.rank, o.value)


# -- ranks built differently ------------------------------------------------------------------


class ShardedEmbedding:
    """A forward with no attention whose one all-reduce takes this rank's dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.table = torch.arange(64 * 4, dtype=dtype).view(64, 4) / 7

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.table[input_ids]
        dist.all_reduce(x)
        return x.float()


def _embedding_executor(par, rank: int):
    return xgraph.GraphExecutor(
        ShardedEmbedding(torch.float32 if rank == 0 else torch.float64),
        inputs=[Input("input_ids", torch.int64, ("num_tokens",), bounds=(0, 64))],
        backend="cpu",
        buckets=[1, 2, 4, 8],
        parallel=par,
    )


def different_worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    par = xgraph.Parallel(tp=group, timeout=TIMEOUT)
    ex_w, _ = tp_pair(group, torch.float32 if rank == 0 else torch.float64)
    step = ex_w.decode_step(random.Random(0), 3)
    out = {}
    for case, kw in (
        ("buckets", {"buckets": BUCKETS if rank == 0 else BUCKETS[:-1]}),
        ("mode", {"buckets": BUCKETS, "mode": "auto" if rank == 0 else "piecewise"}),
        ("dtype", {"buckets": BUCKETS}),
    ):
        w = ex_w if case == "dtype" else tp_pair(group)[0]
        ex = w.executor(backend="cpu", parallel=par, **kw)
        out[case] = _error(lambda e=ex: e(**step.kwargs()))
        ex.close()
    ex = _embedding_executor(par, rank)
    ids = torch.arange(11) % 64  # above the largest bucket: an eager step
    out["eager dtype"] = _error(lambda: ex(input_ids=ids))
    out["graph dtype"] = _error(lambda: ex(input_ids=ids[:3]))
    ex.close()
    return out


def test_ranks_built_differently_raise_on_every_rank_naming_what_differs(missteps):
    for rank, value in enumerate(missteps):
        r = value["different"]
        for case, needle in (
            ("buckets", "buckets (rank 0: [1, 2, 4, 8, 16], rank 1: [1, 2, 4, 8])"),
            ("mode", "mode (rank 0: 'auto', rank 1: 'piecewise')"),
            ("dtype", "KV cache dtypes (rank 0: ['torch.float32'], rank 1: ['torch.float64'])"),
        ):
            name, msg, seconds = r[case]
            assert name == "DistributedError" and needle in msg, (rank, case, msg)
            assert "configured differently" in msg and seconds < TIMEOUT
        for case in ("eager dtype", "graph dtype"):
            name, msg, seconds = r[case]
            assert name == "CollectiveMismatchError", (rank, case, r[case])
            assert "rank 0: eager #0: c10d::allreduce_(float32[11, 4]" in msg or case != (
                "eager dtype"
            ), msg
            assert "float64" in msg and seconds < TIMEOUT
    for case in ("buckets", "mode", "dtype", "eager dtype"):
        assert missteps[0]["different"][case][1] == missteps[1]["different"][case][1], case
