"""When ranks fail: lockstep capture, agreed capture failures, desyncs, dead and hung ranks.

TP=2 on gloo, spawned processes; every test is bounded by run_ranks' deadline (processes
still running then are killed), and every wait inside by the Parallel's timeout.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist

import xgraph
from xgraph import Buckets, GraphMemory
from xgraph.distributed.spawn import run_ranks
from xgraph.models import Workload
from xgraph.models.qwen3_tp import Qwen3TPModel
from xgraph.testing.faults import FaultCounter, books, fail_driver_call

BUCKETS = [1, 2, 4, 8, 16]


def tp_pair(group):
    return [
        Workload(Qwen3TPModel.build("tiny", group, num_blocks=64, block_size=4), 6, 16)
        for _ in range(2)
    ]


def memory_books(mem: GraphMemory) -> dict:
    phys = mem.physical.stats()
    return {k: phys[k] for k in ("spaces", "chunks", "physical_bytes", "virtual_bytes")}


def step_equal(ex, ex_w, ref_w, step, full=True) -> bool:
    out = ex(**step.kwargs()).clone()
    ref = ref_w.eager(ref_w.padded(step, Buckets(BUCKETS), full=full))[: step.num_tokens]
    return torch.equal(out, ref)


# -- 3. lazy capture in lockstep; a capture failing on one rank --------------------------


def _lazy(ex, ex_w, ref_w, rng) -> list:
    """Steps whose buckets are first seen at different steps: captures after each step."""
    rows = []
    for b in [3, 4, 7, 1, 8, 2]:
        ok = step_equal(ex, ex_w, ref_w, ex_w.decode_step(rng, b))
        rows.append((b, ok, ex.stats()["captures"], sorted(ex.stats()["keys"])))
    return rows


def _failing_capture(rank, par, ex_w, ref_w, policy) -> dict:
    """Bucket 16's capture fails on rank 1 only (a map of the shared-physical pool)."""
    backend = xgraph.get_backend("cpu")
    mem = GraphMemory(backend, "shared-physical")
    ex = ex_w.executor(
        backend=backend, buckets=BUCKETS, memory=mem, parallel=par, on_capture_error=policy
    )
    rng = random.Random(5)
    ok = [step_equal(ex, ex_w, ref_w, ex_w.decode_step(rng, b)) for b in (1, 8)]
    before, vm_before = memory_books(mem), books(mem.physical.vm)
    step = ex_w.decode_step(rng, 12)
    err = None
    fails_here = fail_driver_call(mem.physical.vm, "_map_chunk", "ENOMEM (injected)")
    with fails_here if rank == 1 else contextlib.nullcontext(FaultCounter()) as fault:
        try:
            ok.append(step_equal(ex, ex_w, ref_w, step))
        except xgraph.XGraphError as exc:
            err = type(exc).__name__
            ref_w.eager(ref_w.padded(step, Buckets(BUCKETS), full=True))  # caches stay alike
    balanced = memory_books(mem) == before and books(mem.physical.vm) == vm_before
    ok += [step_equal(ex, ex_w, ref_w, ex_w.decode_step(rng, b)) for b in (13, 4, 16)]
    st = ex.stats()
    ex.close()
    mem.close()
    return {
        "fired": fault.fired,
        "error": err,
        "ok": ok,
        "balanced": balanced,
        "failed_keys": list(st["failed_keys"]),
        "eager_keys": list(st["eager_keys"]),
        "keys": st["keys"],
        "closed_books": books(mem.physical.vm),
    }


def capture_worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    ex_w, ref_w = tp_pair(group)
    par = xgraph.Parallel(tp=group, timeout=20)
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, parallel=par)
    lazy = _lazy(ex, ex_w, ref_w, random.Random(1))
    ex.capture([16, 2], progress=False)  # pre-capture in lockstep too: the same on every rank
    ex.capture([16], kind="piecewise", progress=False)
    captured = sorted(ex.stats()["keys"])
    group = xgraph.distributed.group_stats(ex)
    ex.close()
    return {
        "lazy": lazy,
        "captured": captured,
        "same_keys": group["same_keys"],
        "eager": _failing_capture(rank, par, ex_w, ref_w, "eager"),
        "raise": _failing_capture(rank, par, ex_w, ref_w, "raise"),
    }


def test_lazy_capture_in_lockstep_and_a_capture_failing_on_one_rank():
    a, b = (o.value for o in run_ranks(capture_worker, 2, timeout=240))
    # a bucket first seen at step N is captured on both ranks at step N
    assert [r[2:] for r in a["lazy"]] == [r[2:] for r in b["lazy"]]
    assert [r[2] for r in a["lazy"]] == [1, 1, 2, 3, 3, 4]
    assert all(r[1] for r in a["lazy"] + b["lazy"])
    assert a["captured"] == b["captured"] and a["same_keys"]
    assert {("full", 2), ("full", 16), ("piecewise", 16)} <= set(a["captured"])
    for policy in ("eager", "raise"):
        ra, rb = a[policy], b[policy]
        assert rb["fired"] and not ra["fired"]
        for r in (ra, rb):
            assert all(r["ok"]) and r["balanced"], (policy, r)
            assert r["failed_keys"] == [("full", 16)]  # marked alike on every rank
            assert r["closed_books"] == {"reservations": 0, "mappings": 0, "chunks": 0}
        assert ra["keys"] == rb["keys"]
    assert a["eager"]["error"] is None and b["eager"]["error"] is None  # both ran it eagerly
    assert a["eager"]["eager_keys"] == b["eager"]["eager_keys"] == [("full", 16)]
    assert ("full", 16) not in a["eager"]["keys"]
    assert (a["raise"]["error"], b["raise"]["error"]) == ("PeerCaptureError", "VirtualMemoryError")
    assert ("full", 16) in a["raise"]["keys"]  # the next step of the key captured it, on both


# -- 4. injected desync: CaptureError on every rank, naming the collective ------------------


class Desync:
    """A forward that, while armed, issues one more collective whose shape or op depends on
    the rank: the bug behind 'mismatch between collectives' reports."""

    def __init__(self, model, rank: int) -> None:
        self.model, self.rank, self.how = model, rank, None

    def __call__(self, input_ids, positions):
        out = self.model.forward_logits(input_ids, positions)
        if self.how is not None:
            width = 2 if self.how == "shape" and self.rank == 1 else 4
            extra = out[:, :width].contiguous()
            if self.how == "op" and self.rank == 1:
                dist.broadcast(extra, 0)
            else:
                dist.all_reduce(extra)
        return out


def desync_worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    ex_w, ref_w = tp_pair(group)
    par = xgraph.Parallel(tp=group, timeout=20)
    fwd = Desync(ex_w.model, rank)
    backend = xgraph.get_backend("cpu")
    mem = GraphMemory(backend, "shared-physical")
    ex = ex_w.executor(fwd, backend=backend, buckets=BUCKETS, memory=mem, parallel=par)
    rng = random.Random(2)
    out = {"ok": [step_equal(ex, ex_w, ref_w, ex_w.decode_step(rng, 2))]}
    for how, b in (("shape", 3), ("op", 7)):
        before, vm_before = memory_books(mem), books(mem.physical.vm)
        fwd.how = how
        step = ex_w.decode_step(rng, b)
        t0 = time.monotonic()
        try:
            ex(**step.kwargs())
            out[how] = {"error": None}
        except xgraph.CaptureError as exc:
            out[how] = {"error": type(exc).__name__, "message": str(exc)}
        out[how]["seconds"] = time.monotonic() - t0
        out[how]["balanced"] = memory_books(mem) == before and books(mem.physical.vm) == vm_before
        fwd.how = None
        ref_w.eager(ref_w.padded(step, Buckets(BUCKETS), full=True))  # the warm-up's cache writes
        out["ok"].append(step_equal(ex, ex_w, ref_w, step))  # the ranks are still in step
    ex.close()
    mem.close()
    out["closed_books"] = books(mem.physical.vm)
    return out


def test_injected_desync_raises_capture_error_on_every_rank_naming_the_collective():
    outcomes = run_ranks(desync_worker, 2, timeout=180)
    for o in outcomes:
        r = o.value
        assert all(r["ok"]) and r["closed_books"] == {"reservations": 0, "mappings": 0, "chunks": 0}
        for how in ("shape", "op"):
            e = r[how]
            assert e["error"] == "CollectiveMismatchError", (o.rank, e)
            assert e["seconds"] < 10 and e["balanced"], (o.rank, e)
            msg = e["message"]  # the 7th collective (#6) of the warm-up, each rank's version
            rows = 4 if how == "shape" else 8
            assert f"rank 0: warm-up #6: c10d::allreduce_(float32[{rows}, 4]" in msg, msg
            other = "allreduce_(float32[4, 2]" if how == "shape" else "broadcast_(float32[8, 4]"
            assert f"rank 1: warm-up #6: c10d::{other}" in msg, msg
    assert outcomes[0].value["shape"]["message"] == outcomes[1].value["shape"]["message"]


# -- 4. a rank killed mid-step, a rank dead between steps, a rank that hangs ----------------


def _executor(rank, buckets, timeout, forward=None):
    group = dist.group.WORLD
    ex_w, ref_w = tp_pair(group)
    par = xgraph.Parallel(tp=group, timeout=timeout)
    backend = xgraph.get_backend("cpu")
    mem = GraphMemory(backend, "shared-physical")
    fwd = forward(ex_w.model) if forward else None
    ex = ex_w.executor(fwd, backend=backend, buckets=buckets, memory=mem, parallel=par)
    return ex, ex_w, ref_w, mem


def _survive(ex, mem, call) -> dict:
    """Run `call`; the error, how long it took, and the books once the executor is closed."""
    t0 = time.monotonic()
    try:
        call()
        err, msg = None, ""
    except Exception as exc:
        err, msg = type(exc).__name__, str(exc)
    seconds = time.monotonic() - t0
    try:
        ex(
            **{
                "input_ids": torch.zeros(1, dtype=torch.int64),
                "positions": torch.zeros(1, dtype=torch.int64),
            }
        )
        again = None
    except Exception as exc:
        again = type(exc).__name__
    ex.close()
    mem.close()
    return {
        "error": err,
        "message": msg,
        "seconds": seconds,
        "again": again,
        "books": books(mem.physical.vm),
    }


class KillMidStep:
    """Rank 1 dies (SIGKILL) inside the forward, between two all-reduces, while armed."""

    def __init__(self, model) -> None:
        self.model, self.armed = model, False

    def __call__(self, input_ids, positions):
        if self.armed and dist.get_rank() == 1:
            self.model.embed(input_ids)  # one all-reduce done
            os.kill(os.getpid(), signal.SIGKILL)
        return self.model.forward_logits(input_ids, positions)


def kill_worker(rank: int, world: int, where: str) -> dict:
    ex, ex_w, ref_w, mem = _executor(
        rank, [1, 2, 4], 5, KillMidStep if where == "mid-step" else None
    )
    rng = random.Random(3)
    for b in (2, 6):  # a graph step and an eager one (above the buckets): both work
        step_equal(ex, ex_w, ref_w, ex_w.decode_step(rng, b))
    step = ex_w.decode_step(rng, 6)  # eager: the forward's Python runs, so it can die there
    if where == "mid-step":
        ex.forward.armed = True
    elif rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dead before the step's agreement
    return _survive(ex, mem, lambda: ex(**step.kwargs()))


def hang_worker(rank: int, world: int) -> dict:
    ex, ex_w, ref_w, mem = _executor(rank, [1, 2, 4], 3)
    rng = random.Random(4)
    step_equal(ex, ex_w, ref_w, ex_w.decode_step(rng, 2))
    if rank == 1:
        time.sleep(8)  # never calls the next step in time
        return {"slept": True}
    return _survive(ex, mem, lambda: ex(**ex_w.decode_step(rng, 2).kwargs()))


@pytest.mark.parametrize("where", ["mid-step", "between steps"])
def test_a_rank_killed_makes_the_survivor_raise_within_the_timeout(where):
    dead, alive = None, None
    for o in run_ranks(kill_worker, 2, args=(where,), timeout=120, group_timeout=5, check=False):
        if o.rank == 1:
            dead = o
        else:
            alive = o
    assert dead.status == "died" and dead.exitcode == -signal.SIGKILL
    assert alive.status == "ok", alive
    r = alive.value
    assert r["error"] == "DistributedError" and r["seconds"] < 5 + 2, r
    assert "close it" in r["message"].lower() or "close the executor" in r["message"].lower()
    assert r["again"] == "DistributedError"  # the executor refuses further steps
    assert r["books"] == {"reservations": 0, "mappings": 0, "chunks": 0}


def test_a_rank_that_hangs_makes_the_other_raise_at_the_timeout():
    alive, sleeper = run_ranks(hang_worker, 2, timeout=120, group_timeout=5)
    r = alive.value
    assert r["error"] == "DistributedError" and 3 <= r["seconds"] < 3 + 3, r
    assert "within 3 s" in r["message"], r["message"]
    assert r["again"] == "DistributedError"
    assert r["books"] == {"reservations": 0, "mappings": 0, "chunks": 0}
    assert sleeper.value == {"slept": True}
