"""Tensor parallelism against the single-rank model and against float32 (issue 33 item 7).

- Over a group of one the TP model runs the single-rank model's kernels: eager and through
  the executor (decode full graphs, piecewise prefill) its outputs and KV cache equal the
  single-rank model's bit for bit in float32, also where the backend installs a linear
  kernel of its own (CUDA's skinny kernel rounds unlike F.linear; here a float64 one).
- The TP tool's criterion (xgraph.bench.distributed_fidelity): a graph path is no further
  from a float32 reference of the same weights than eager bf16 is; checked on the CPU in
  bf16 through the bench's rows (every number present), and a path error is caught.

Every multi-process test is bounded by run_ranks' deadline.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import xgraph
from xgraph.distributed.spawn import run_ranks
from xgraph.models import Workload
from xgraph.models.qwen3_tp import Qwen3TPModel

BUCKETS = [1, 2, 4, 8, 16]
DECODE = [3, 1, 8, 16]
PREFILL = [[5, 3], [9], [2, 2, 4]]


def _float64_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A backend linear kernel that rounds unlike F.linear (float64 accumulation)."""
    return (x.double() @ w.double().T).to(x.dtype)


def _against_single_rank(kernel: bool) -> list:
    """(batch, eager equal, executors equal, caches equal) per step, and both key lists."""
    group = dist.group.WORLD
    one = Workload.tiny(num_blocks=64, block_size=4, max_blocks=6, max_seqs=16)
    one.randomize_cache(5)
    tp = Workload(Qwen3TPModel.build("tiny", group, num_blocks=64, block_size=4), 6, 16)
    for mine, full in zip(tp.cache.tensors(), one.cache.tensors()):
        mine.copy_(full)  # a group of one holds every kv head
    ex_tp = tp.executor(backend="cpu", buckets=BUCKETS, parallel=xgraph.Parallel(tp=group))
    ex_one = one.executor(backend="cpu", buckets=BUCKETS)
    # after the executors: building one activates the backend, which installs its kernels
    xgraph.linear.install("cpu", _float64_linear if kernel else None, "test")
    rng, rows = random.Random(7), []
    for b in DECODE + PREFILL:
        step = tp.decode_step(rng, b) if isinstance(b, int) else tp.prefill_step(rng, b)
        eager = torch.equal(tp.eager(step), one.eager(step))
        graphs = torch.equal(ex_tp(**step.kwargs()), ex_one(**step.kwargs()))
        caches = all(torch.equal(a, c) for a, c in zip(tp.cache.tensors(), one.cache.tensors()))
        rows.append((b, eager, graphs, caches))
    keys = (ex_tp.stats()["keys"], ex_one.stats()["keys"])
    ex_tp.close()
    ex_one.close()
    xgraph.linear.install("cpu", None, "test")
    return [rows, keys]


def _bench_rows() -> dict:
    """The TP bench's decode and prefill rows of the tiny model in bf16 on the CPU."""
    from xgraph.bench import distributed as bench

    group = dist.group.WORLD
    be = xgraph.get_backend("cpu")
    w, w1 = bench.workloads(be, "tiny", group, 4, 64, torch.bfloat16)
    par = xgraph.Parallel(tp=group, timeout=60)
    return {
        "decode": bench.decode_rows(be, w, w1, par, [1, 4], 2),
        "prefill": bench.prefill_rows(be, w, par, [16], 2, w1),
    }


def group_of_one_worker(rank: int, world: int) -> dict:
    out: dict = {kernel: _against_single_rank(kernel) for kernel in (False, True)}
    out["bench"] = _bench_rows()
    return out


@pytest.fixture(scope="module")
def group_of_one() -> dict:
    (o,) = run_ranks(group_of_one_worker, 1, timeout=240)
    return o.value


def test_tp_over_a_group_of_one_equals_the_single_rank_model_bitwise(group_of_one):
    for kernel in (False, True):
        rows, (tp_keys, one_keys) = group_of_one[kernel]
        assert all(e and g and c for _, e, g, c in rows), (kernel, rows)
        assert tp_keys == one_keys and {k[0] for k in tp_keys} == {"full", "piecewise"}


NUMBERS = ["exec_vs_eager", "exec_vs_fp32", "eager_vs_fp32", "bound", "exec_vs_single_max_abs"]


def test_the_bench_rows_hold_every_number_and_the_criterion_in_bf16(group_of_one):
    rows = [r for r in group_of_one["bench"]["decode"] if "batch" in r]
    rows += group_of_one["bench"]["prefill"]
    assert [r.get("batch", r.get("tokens")) for r in rows] == [1, 4, 16]
    for r in rows:
        assert all(isinstance(r[k], float) for k in NUMBERS), r
        assert r["hand_vs_fp32"] is None  # the CPU backend has no graph API of its own
        # the CPU's graphs replay eager's ops: the same distance to float32, bit for bit
        assert r["exec_vs_fp32"] == r["eager_vs_fp32"] and 0 < r["eager_vs_fp32"] < 0.05
        assert r["bound"] == pytest.approx(1.25 * r["eager_vs_fp32"] + 1e-3)
        assert r["within_fp32_bound"] and r["exec_equals_single"] and r["equal"]


def test_the_criterion_takes_a_path_as_close_to_float32_as_eager_and_refuses_a_worse_one():
    from xgraph.bench.distributed_fidelity import distances

    g = torch.Generator().manual_seed(0)
    fp32 = torch.randn(8, 4096, generator=g)
    eager = fp32 + 0.03 * torch.randn(8, 4096, generator=g)  # a bf16 path's distance
    other = fp32 + 0.03 * torch.randn(8, 4096, generator=g)  # another path, as far
    assert distances(other, eager, fp32)["equal"]
    assert distances(eager.clone(), eager, fp32, single=eager.clone())["equal"]
    worse = distances(eager * (1 + 2**-4), eager, fp32)  # a 6% error on top of eager's
    assert not worse["equal"] and worse["exec_vs_fp32"] > worse["bound"]
    assert not distances(other, eager, fp32, single=eager)["equal"]  # not the single rank's
    f32 = distances(fp32 + 1e-7, fp32)  # float32: bit for bit or nothing
    assert not f32["equal"] and distances(fp32.clone(), fp32)["equal"]
