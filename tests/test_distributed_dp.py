"""Data parallelism with an expert-parallel MoE: DP=2 on gloo, spawned processes.

The ranks run their own batches, of different sizes, one of them idle at times: they agree
on one key (padded to the larger count, the communication dim in the key), their MoE
all-to-alls meet, and every rank's output equals the same model run eagerly on the same
padded step bit for bit, and the dense single-process MoE within 1e-5.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

import xgraph
from xgraph import Buckets, Dim
from xgraph.distributed import comm_sizes
from xgraph.distributed.spawn import run_ranks
from xgraph.models import Workload
from xgraph.models.moe import COMM_DIM, MoEConfig, MoEModel
from xgraph.models.workload import Step
from xgraph.options import Kind
from xgraph.runners import PagedPrefillRunner
from xgraph.staging import StepStaging

BUCKETS = [1, 2, 4, 8, 16]
COMM_BUCKETS = [4, 16]  # coarser than num_tokens': the comm dim is its own part of the key
# tokens per step of (rank 0, rank 1); 0: idle; a list: a prefill of those query lengths
PLAN = [(3, 5), (0, 7), (2, 0), (4, 4), ([3, 2], 1), (0, 0), (9, 2), (1, [4, 4])]


def moe_workloads(group):
    """The EP model for the executor, the same for the eager reference, and the dense one."""
    c = MoEConfig.tiny()
    models = [MoEModel.build(c, group, num_blocks=64), MoEModel.build(c, group, num_blocks=64)]
    models.append(MoEModel.build(c, None, num_blocks=64))
    return [Workload(m, 6, 16) for m in models]


def reference(ex, ref_w, step: Step | None, kind: str, tokens: int, comm: int):
    """The agreed step run eagerly (an idle rank: over dummy tokens, its output dropped)."""
    full = kind == Kind.FULL.value
    if step is None:
        tensors, attn = ex.planner.synthetic(tokens, Kind.FULL if full else Kind.PIECEWISE, {})
        step = Step(tensors["input_ids"], tensors["positions"], attn)
    padded = ref_w.padded(step, Buckets([tokens]), full=full)
    with comm_sizes(**{COMM_DIM: comm}):  # piecewise: the prefill runner, as the executor's
        if full:
            return ref_w.eager(padded)[: step.num_tokens]
        return ref_w.eager(padded, PagedPrefillRunner(), num_tokens=step.num_tokens)[
            : step.num_tokens
        ]


def count_stagings(counts: list[int]) -> None:
    """Count writes of a step into the persistent buffers (this process only) in counts[-1]."""
    stage = StepStaging.stage

    def counted(self, *args):  # type: ignore[no-untyped-def]
        counts[-1] += 1
        return stage(self, *args)

    StepStaging.stage = counted  # type: ignore[method-assign]


def dp_worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    ex_w, ref_w, dense = moe_workloads(group)
    par = xgraph.Parallel(dp=group, ep=group, comm_dims=[COMM_DIM], timeout=30)
    dims = [Dim(COMM_DIM, max(BUCKETS), buckets=COMM_BUCKETS)]
    ex = ex_w.executor(backend="cpu", buckets=BUCKETS, dims=dims, parallel=par)
    rng = random.Random(rank)
    rows = []
    stagings: list[int] = []
    count_stagings(stagings)
    for plan in PLAN:
        mine = plan[rank]
        before = ex.stats()["hits"]
        stagings.append(0)
        step = None
        if mine == 0:
            ex.idle_step()
        else:
            step = (
                ex_w.decode_step(rng, mine)
                if isinstance(mine, int)
                else ex_w.prefill_step(rng, mine)
            )
            out = ex(**step.kwargs()).clone()
        st = ex.stats()
        comm = st["parallel"]["comm"].get(COMM_DIM)
        new = [k for k in st["keys"] if k not in before]
        hit = [k for k, h in st["hits"].items() if h > before.get(k, 0)]
        key = (new + hit)[0] if new + hit else None
        if all(p == 0 for p in plan):
            rows.append({"plan": plan, "key": key, "ran": comm is not None})
            continue
        ref = reference(ex, ref_w, step, key[0], key[1], comm)
        row = {"plan": plan, "key": key, "comm": comm}
        if step is not None:
            row["equal"] = torch.equal(out, ref)
            row["dense"] = float((out - dense.eager(step)).abs().max())
        rows.append(row)
    st = ex.stats()
    planner = type(ex.planner).__name__
    ex.close()
    return {
        "rows": rows,
        "keys": st["keys"],
        "parallel": st["parallel"],
        "stagings": stagings,
        "planner": planner,
    }


def _size(x) -> int:
    return x if isinstance(x, int) else sum(x)


def test_dp_ep_ranks_with_different_counts_and_idle_ranks_agree_and_equal_eager():
    outcomes = run_ranks(dp_worker, 2, timeout=240)
    a, b = (o.value for o in outcomes)
    assert [r["key"] for r in a["rows"]] == [r["key"] for r in b["rows"]]  # one key per step
    for o in outcomes:
        for row in o.value["rows"]:
            plan = row["plan"]
            n = max(_size(p) for p in plan)
            if n == 0:  # every rank idle: nothing runs, nothing is agreed beyond that
                assert row["key"] is None
                continue
            kind, tokens, comm = row["key"]
            # padded to the larger count; the comm dim (the larger count, its own buckets)
            assert tokens == Buckets(BUCKETS).pad(n) and comm == Buckets(COMM_BUCKETS).pad(n)
            assert row["comm"] == comm
            prefill = any(isinstance(p, list) for p in plan)
            assert kind == ("piecewise" if prefill else "full")  # a prefill among decodes
            if "equal" in row:
                assert row["equal"], (o.rank, row)
                assert row["dense"] <= 1e-5, (o.rank, row)
        p = o.value["parallel"]
        assert p["idle_steps"] == sum(1 for plan in PLAN if plan[o.rank] == 0)
        last = max(_size(x) for x in PLAN[-1])
        assert p["comm"] == {COMM_DIM: Buckets(COMM_BUCKETS).pad(last)}  # in stats()
    assert a["keys"] == b["keys"] and all(len(k) == 3 for k in a["keys"])
    for o in outcomes:  # decided, agreed, then staged once: a rank padded up stages once too
        ran = [0 if all(_size(p) == 0 for p in plan) else 1 for plan in PLAN]
        assert o.value["stagings"] == ran, (o.rank, o.value["stagings"])
        assert o.value["planner"] == "StepPlanner"  # the executor's own, not a stand-in
        assert "replans" not in o.value["parallel"]
    for key, manifest in a["parallel"]["manifests"].items():
        assert manifest == b["parallel"]["manifests"][key]
        assert sum("alltoall_base_" in c for c in manifest) == 3  # dispatch, ids, combine
