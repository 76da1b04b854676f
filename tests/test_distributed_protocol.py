"""The pieces of graphs across ranks: the agreement rule, the manifest recorder, the CPU
tape's collectives, world size 1, and the bounded launcher. Multi-process parts run on
gloo in spawned processes, each bounded by run_ranks' deadline."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import xgraph
from xgraph import Buckets
from xgraph.distributed import agreement as ag
from xgraph.distributed.manifest import first_difference
from xgraph.distributed.spawn import RanksFailed, run_ranks
from xgraph.models import Workload
from xgraph.options import Kind
from xgraph.steps import Checked, Decision

DIMS = ["num_tokens", "num_comm_tokens"]
COMM = {"num_comm_tokens": Buckets([4, 16])}


def _Step(kind, n, padded=None, reason=""):
    """A rank's checked step of n tokens and its decision."""
    checked = Checked({}, {"num_tokens": n}, [], None)
    return checked, Decision(kind, None, padded or {}, reason)


def table(*rows):
    return [ag.message(st, *(s or (None, None)), DIMS, ag.Stamp(cache=(2, 0))) for s, st in rows]


def test_the_least_path_wins_and_every_key_dim_is_padded_to_the_largest():
    t = table(
        (_Step(Kind.FULL, 3, {"num_tokens": 4, "num_comm_tokens": 4}), ag.OK),
        (_Step(Kind.PIECEWISE, 7, {"num_tokens": 8, "num_comm_tokens": 16}), ag.OK),
        (None, ag.IDLE),
    )
    a = ag.decide(t, DIMS, COMM)
    assert a.kind is Kind.PIECEWISE and a.tokens == 7
    assert a.pad_to == {"num_tokens": 8, "num_comm_tokens": 16} and a.comm == {
        "num_comm_tokens": 16
    }


def test_one_eager_rank_makes_every_rank_eager_and_says_why():
    t = table(
        (_Step(Kind.FULL, 3, {"num_tokens": 4}), ag.OK),
        (_Step(Kind.EAGER, 9, reason="above largest bucket"), ag.OK),
    )
    a = ag.decide(t, DIMS, COMM)
    assert a.kind is Kind.EAGER and a.reason == "rank 1: above largest bucket" and a.pad_to == {}
    assert a.comm == {"num_comm_tokens": 16}  # the forward still sees the agreed comm size


def test_a_comm_dim_above_its_buckets_makes_every_rank_eager():
    t = table((_Step(Kind.FULL, 20, {"num_tokens": 32}), ag.OK))
    a = ag.decide(t, DIMS, COMM)
    assert a.kind is Kind.EAGER and "num_comm_tokens=20 above its largest bucket 16" in a.reason
    assert a.comm == {"num_comm_tokens": 20}


def test_all_idle_runs_nothing_and_diverged_caches_and_tp_groups_are_named():
    assert ag.decide(table((None, ag.IDLE), (None, ag.IDLE)), DIMS, COMM).kind is None
    t = table((None, ag.IDLE), (None, ag.IDLE))
    t[1][ag.F_GRAPHS] = 3
    assert "graph caches differ (rank 0: 2 graphs" in ag.divergence(t)
    t = [
        ag.message(ag.OK, *_Step(Kind.FULL, n, {"num_tokens": 4}), DIMS, ag.Stamp(tp=leader))
        for n, leader in ((3, 0), (3, 0), (2, 2), (4, 2))
    ]
    msg = ag.tp_mismatch(t)
    assert "ranks [2, 3] form one tensor-parallel group" in msg and "rank 2: 2 tokens" in msg
    assert ag.tp_mismatch(t[:2]) is None


def test_first_difference_names_each_ranks_version():
    assert first_difference([["a", "b"], ["a", "b"]]) == (-1, [])
    assert first_difference([["a", "b"], ["a", "c"]]) == (1, ["b", "c"])
    assert first_difference([["a"], ["a", "c"]]) == (1, ["(none: its forward ended)", "c"])


def test_parallel_needs_an_initialised_process_group_and_comm_size_a_step():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(xgraph.XGraphError, match="init_process_group"):
        xgraph.Parallel()
    with pytest.raises(xgraph.XGraphError, match="Parallel\\(comm_dims"):
        xgraph.distributed.comm_size()
    with xgraph.distributed.comm_sizes(num_comm_tokens=8):
        assert xgraph.distributed.comm_size() == 8


# -- the recorder sees plain torch.distributed calls; the CPU tape replays them -------------


def collectives(group):
    """One of each kind of collective a forward may issue, on plain tensors."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        dist.all_reduce(y, group=group)
        g = torch.empty(2 * y.shape[0], *y.shape[1:])
        dist.all_gather_into_tensor(g, y, group=group)
        a = torch.empty_like(g)
        dist.all_to_all_single(a, g, group=group)
        dist.broadcast(a, 0, group=group)
        group.allreduce([a]).wait()  # the ProcessGroup method, below dist.*
        m = fc.all_reduce(a, "max", group)  # a functional collective
        return m * 2 + y.sum()

    return forward


def recorder_worker(rank: int, world: int) -> dict:
    from xgraph.distributed import CollectiveRecorder
    from xgraph.distributed.manifest import GroupLabels

    group = dist.new_group([0, 1], backend="gloo")
    fwd = collectives(group)
    x = torch.arange(8.0).view(4, 2) + rank
    rec = CollectiveRecorder(GroupLabels({"tp": group}))
    with rec:
        eager = fwd(x)
    backend = xgraph.get_backend("cpu")
    g = backend.new_graph()
    with xgraph.graph(g):
        out = fwd(x)
    first = torch.equal(eager, out)  # the capture computed the values too (CPU backend)
    same = []
    for i in range(5):  # the recorded collectives run again on new values, waited for
        x.add_(i)
        ref = fwd(x)
        g.replay()
        same.append(torch.equal(out, ref))
    del out  # pool memory: gone with the graph's own pool at reset
    g.reset()
    return {"manifest": [str(c) for c in rec.manifest], "first": first, "same": same}


def test_the_recorder_sees_plain_collectives_and_the_cpu_tape_replays_them():
    a, b = (o.value for o in run_ranks(recorder_worker, 2, timeout=120))
    assert a["manifest"] == b["manifest"]
    assert a["manifest"] == [
        "c10d::allreduce_(float32[4, 2], reduce_op=SUM) on tp",
        "c10d::_allgather_base_(float32[8, 2], float32[4, 2]) on tp",
        "c10d::alltoall_base_(float32[8, 2], float32[8, 2], output_split_sizes=[], "
        "input_split_sizes=[]) on tp",
        "c10d::broadcast_(float32[8, 2], root_rank=0, root_tensor=0) on tp",
        "c10d::allreduce_(float32[8, 2], reduce_op=SUM) on tp",
        "_c10d_functional::all_reduce(float32[8, 2], reduce_op=MAX) on tp",
    ]
    assert a["first"] and all(a["same"]) and all(b["same"])


# -- world size 1: a Parallel of one rank runs as a single rank does ------------------------


def single_rank_worker(rank: int, world: int) -> dict:
    w = Workload.tiny(num_blocks=64, block_size=4, max_blocks=6, max_seqs=16)
    plain = Workload(w.model, 6, 16)  # the same model and cache
    par = xgraph.Parallel(tp=dist.group.WORLD)
    a = w.executor(backend="cpu", buckets=[1, 2, 4, 8], parallel=par, name="par")
    b = plain.executor(backend="cpu", buckets=[1, 2, 4, 8], name="plain")
    rng = random.Random(0)
    equal = []
    for n in (3, 8, 1, 3):
        step = w.decode_step(rng, n)
        equal.append(torch.equal(a(**step.kwargs(), clone=True), b(**step.kwargs(), clone=True)))
    planner_wrapped = type(a.planner).__name__
    st = a.stats()
    group = xgraph.distributed.group_stats(a)
    a.close()
    b.close()
    return {
        "equal": equal,
        "planner": planner_wrapped,
        "parallel": st["parallel"],
        "group": group,
        "duty": _duty_checked_once(w),
    }


def _duty_checked_once(w: Workload) -> dict:
    """Backend.prepare_collectives runs once per group, and a failing one is named."""
    backend = xgraph.get_backend("cpu")
    calls = []
    original = backend.prepare_collectives
    backend.prepare_collectives = lambda groups: calls.append(len(groups)) or original(groups)
    par = xgraph.Parallel(tp=dist.group.WORLD)
    for name in ("a", "b"):  # two executors on one Parallel: one preparation
        w.executor(backend=backend, buckets=[1], parallel=par, name=name).close()

    def refuse(groups):
        raise RuntimeError("no communicator")

    backend.prepare_collectives = refuse
    try:
        w.executor(backend=backend, buckets=[1], parallel=xgraph.Parallel(tp=dist.group.WORLD))
        error = None
    except xgraph.XGraphError as exc:
        error = str(exc)
    finally:
        del backend.prepare_collectives
    return {"calls": calls, "error": error}


def test_a_parallel_of_one_rank_exchanges_nothing_and_keeps_the_plain_planner():
    r = run_ranks(single_rank_worker, 1, timeout=120)[0].value
    assert all(r["equal"]) and r["planner"] == "StepPlanner"
    p = r["parallel"]
    assert p["exchanges"] == 0 and p["agreements"] == 0 and p["world_size"] == 1
    assert set(p["manifests"]) == {("full", 4), ("full", 8), ("full", 1)}
    assert p["manifests"][("full", 4)] == []  # the single-rank model issues no collective
    assert r["group"]["graph_bytes_total"] == r["group"]["ranks"][0]["graph_bytes"] > 0
    assert r["duty"]["calls"] == [1]
    assert "could not prepare collectives" in r["duty"]["error"]
    assert "RuntimeError: no communicator" in r["duty"]["error"]


def group_backend_worker(rank: int, world: int) -> str:
    backend = xgraph.get_backend("cpu")
    backend.collective_backend = "nccl"  # as the CUDA adapter declares it
    try:
        backend.prepare_collectives([dist.group.WORLD])
    except xgraph.XGraphError as exc:
        return str(exc)
    finally:
        del backend.collective_backend
    return "accepted"


def test_a_group_of_another_backend_than_the_declared_one_is_refused():
    error = run_ranks(group_backend_worker, 1, timeout=120)[0].value
    assert "has backend 'gloo'" in error and "need nccl" in error
    assert "create the group with backend='nccl'" in error


def reopen_worker(rank: int, world: int) -> list:
    """Parallels made and closed in turn over the same ranks, each exchanging once."""
    seen = []
    for i in range(3):
        par = xgraph.Parallel(tp=dist.group.WORLD, timeout=20)
        seen.append([m[:3] for m in par.channel.exchange([1, rank, i], "a test exchange")])
        par.close()
        if rank == 1:
            time.sleep(2)  # rank 0 rendezvous first, as a rank ahead of the other does
    return seen


def test_a_parallel_closed_then_made_again_over_the_same_ranks_connects():
    """torch names a side group (created with local synchronization) by its ranks and the
    count of live groups: destroying one on close let the next take its name, and its
    rendezvous read the dead group's addresses (connection refused)."""
    for outcome in run_ranks(reopen_worker, 2, timeout=120):
        assert outcome.value == [[[1, 0, i], [1, 1, i]] for i in range(3)]


def refused_side_group_worker(rank: int, world: int) -> str:
    def refuse(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed")

    real, dist.new_group = dist.new_group, refuse
    try:
        xgraph.Parallel(tp=dist.group.WORLD, timeout=5)
    except xgraph.XGraphError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.new_group = real
    return "made"


def test_a_side_group_that_cannot_be_made_is_a_distributed_error_naming_why():
    for outcome in run_ranks(refused_side_group_worker, 2, timeout=120):
        assert outcome.value.startswith("DistributedError: Parallel: the side group over ranks")
        assert "RuntimeError: Gloo connectFullMesh failed" in outcome.value
        assert "makes its Parallel at the same point" in outcome.value


# -- the launcher bounds every run ----------------------------------------------------------


def slow_worker(rank: int, world: int) -> str:
    # both ranks past the group's set-up first: a rank 0 that raised while rank 1 still
    # connected tore the store down under it (rank 1 then raised instead of sleeping)
    dist.barrier()
    if rank == 1:
        time.sleep(300)
    if rank == 0:
        raise ValueError("rank 0 refuses")
    return "done"


def test_run_ranks_kills_what_outlives_its_deadline_and_reports_each_rank():
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(slow_worker, 2, timeout=30)  # room for two processes to start on busy cores
    assert time.monotonic() - t0 < 45
    statuses = [o.status for o in info.value.outcomes]
    assert statuses == ["raised", "killed"]
    assert "ValueError: rank 0 refuses" in info.value.outcomes[0].error
