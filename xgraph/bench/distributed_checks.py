"""Checks of graphs across ranks a multi-GPU run makes besides timing (the CUDA adapter's
adapters/cuda/tools/tp_graphs.py).

- `memory_orders`: shared-physical graph memory per rank, capturing the decode buckets in
  ascending, random and largest-first order, against the largest bucket captured alone: the
  pool's physical bytes (data memory) and, apart, what the driver holds beyond them (graph
  executables), by the backend's reading;
- `desync`: one rank's forward issues one more collective of another shape than the
  others': every rank must raise CollectiveMismatchError, within the timeout;
- `moe`: data-parallel ranks with different token counts, one of them idle, through an
  expert-parallel MoE: one agreed key per step, outputs against eager on the same padded
  step.

Every function is collective: call it on every rank at the same point.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
import torch.distributed as dist

from .. import distributed as xdist
from ..buckets import Buckets, Dim
from ..interfaces import Backend
from ..memory import GraphMemory, settled_reading
from ..models import Workload
from ..models.moe import COMM_DIM, MoEConfig, MoEModel
from ..models.workload import Step
from ..options import Kind
from .distributed import compare


def memory_orders(backend: Backend, w: Workload, par: Any, sizes: list[int]) -> dict[str, Any]:
    """Graph memory of capturing `sizes` in three orders, and of the largest alone."""
    orders = {
        "largest alone": [max(sizes)],
        "ascending": sorted(sizes),
        "random": random.Random(0).sample(sizes, len(sizes)),
        "largest first": sorted(sizes, reverse=True),
    }
    out: dict[str, Any] = {}
    for name, order in orders.items():
        mem = GraphMemory(backend, "shared-physical")
        ex = w.executor(backend=backend, buckets=sizes, memory=mem, parallel=par, name=name)
        ex.warm_up([max(sizes)])  # kernels load and libraries set up before the reading
        before = settled_reading(backend)
        t0 = time.perf_counter()
        ex.capture(order, progress=False)
        seconds = time.perf_counter() - t0
        after = settled_reading(backend)
        data = mem.graph_bytes()
        driver = None if before is None or after is None else after - before
        out[name] = {
            "graphs": len(order),
            "data_bytes": data,
            "driver_bytes": driver,
            "executables_bytes": None if driver is None else driver - data,
            "capture_s": seconds,
        }
        ex.close()
        mem.close()
    alone = out["largest alone"]["data_bytes"] or 1
    for row in out.values():
        row["data_vs_largest_alone"] = row["data_bytes"] / alone
    return out


class Skewed:
    """A forward whose extra all-reduce's width depends on the rank while armed: the kind of
    rank-dependent code behind 'mismatch between collectives' reports."""

    def __init__(self, model: Any) -> None:
        self.model, self.armed = model, False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model.forward_logits(input_ids, positions)
        if self.armed:
            extra = out[:, : 2 + dist.get_rank()].contiguous()
            dist.all_reduce(extra)
        return out


def desync(backend: Backend, w: Workload, par: Any, batch: int = 4) -> dict[str, Any]:
    """Arm the skewed forward on a fresh key: each rank's error and how long it took."""
    fwd = Skewed(w.model)
    ex = w.executor(fwd, backend=backend, buckets=[batch], parallel=par, name="desync")
    step = w.decode_step(random.Random(9), batch)
    fwd.armed = True
    t0 = time.monotonic()
    try:
        ex(**step.kwargs())
        row: dict[str, Any] = {"error": None}
    except Exception as exc:
        row = {"error": type(exc).__name__, "message": str(exc)[:2000]}
    row["seconds"] = time.monotonic() - t0
    row["timeout_s"] = par.timeout
    fwd.armed = False
    row["next_step_ok"] = bool(torch.isfinite(ex(**step.kwargs())).all())
    ex.close()
    return row


def moe(backend: Backend, group: Any, plan: list[tuple], dtype: torch.dtype) -> list[dict]:
    """DP ranks over an EP MoE: `plan` gives each step's token count per rank (0: idle)."""
    c, dev, rank = MoEConfig.tiny(), backend.device, dist.get_rank(group)
    ex_w, ref_w = (
        Workload(MoEModel.build(c, group, num_blocks=64, dtype=dtype, device=dev), 6, 16)
        for _ in range(2)
    )
    sizes = [1, 2, 4, 8, 16]
    par = xdist.Parallel(dp=group, ep=group, comm_dims=[COMM_DIM], timeout=60)
    dims = [Dim(COMM_DIM, 16, buckets=[4, 16])]
    ex = ex_w.executor(backend=backend, buckets=sizes, dims=dims, parallel=par, name="moe")
    rng, rows = random.Random(rank), []
    for counts in plan:
        counts = tuple(counts[: dist.get_world_size(group)])  # a smaller group: its ranks
        n = counts[rank]
        step = ex_w.decode_step(rng, n) if n else None
        out = ex(**step.kwargs(), clone=True) if step is not None else ex.idle_step()
        agreed = ex.stats()["parallel"]["comm"].get(COMM_DIM)
        tokens = Buckets(sizes).pad(max(counts))
        ref = _reference(ex, ref_w, step, tokens, agreed)
        row: dict[str, Any] = {"counts": counts, "comm": agreed, "keys": len(ex.stats()["keys"])}
        if step is not None:
            row.update(compare(out, ref))
        rows.append(row)
    ex.close()
    par.close()
    return rows


def _reference(ex: Any, ref_w: Workload, step: Step | None, tokens: int, comm: int) -> Any:
    """The agreed decode step run eagerly (an idle rank: its dummy tokens, output dropped)."""
    if step is None:
        tensors, attn = ex.planner.synthetic(tokens, Kind.FULL, {})
        step = Step(tensors["input_ids"], tensors["positions"], attn)
    padded = ref_w.padded(step, Buckets([tokens]), full=True)
    with xdist.comm_sizes(**{COMM_DIM: comm}):
        return ref_w.eager(padded)[: step.num_tokens]
