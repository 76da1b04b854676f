"""`xgraph bench distributed`: graphs across ranks, one process per device, under torchrun.

    torchrun --nproc-per-node 2 --no-python xgraph bench distributed --backend cuda
    torchrun --nproc-per-node 2 --no-python xgraph bench distributed --backend cpu  # gloo

Without torchrun it runs as a group of one (a world-size-1 group: NCCL on CUDA, gloo on the
CPU), which is how one device checks collectives inside graphs. The reference decoder is
sharded over every rank (tensor parallelism, Qwen3TPModel); per decode batch each rank
measures, side by side in the same run:

- `step`: one executor step (the agreement, staging, the replay with the collectives in it);
- `agree_us`: the host time of the step's agreement alone (one exchange on the side group);
- `tp1`: the single-rank model through a plain executor on the same device (the anchor:
  what tensor parallelism buys or costs at this size);
- `raw`: the TP forward captured with the runtime's own graph API (no xgraph), replayed;
- outputs: the executor's, eager's (the same TP model on the padded step), the hand-captured
  graph's and, over a group of one, the single-rank executor's, each against a float32 copy
  of the same weights (xgraph.bench.distributed_fidelity: the criterion and every number).

Then piecewise prefill steps (the same checks), and graph memory per rank. Times are medians
of device timings where the backend has a device timer (CPU: host wall time, which only
proves the path runs; only GPU times count). Rank 0 writes the JSON with every rank's rows.
"""

from __future__ import annotations

import datetime
import os
import random
from typing import Any

import torch
import torch.distributed as dist

from .. import distributed as xdist
from ..attention import step_context
from ..buckets import Buckets
from ..distributed.agreement import OK, Stamp, decide, message
from ..distributed.channel import Channel
from ..interfaces import Backend
from ..models import Qwen3Model, Workload
from ..models.qwen3_config import Qwen3Config
from ..models.qwen3_tp import Qwen3TPModel, qwen3_8b
from ..runners import PagedPrefillRunner
from . import hooks
from .anchors import static_inputs
from .distributed_fidelity import Fidelity, fill_cache
from .report import attempt, note, table
from .timing import Timer, host_time

_made = False  # whether init_group made the default group (release_group ends it)


def init_group(device_type: str) -> tuple[int, int, int]:
    """(rank, world size, local rank): torchrun's group, else a group of one on this host."""
    global _made
    if not dist.is_initialized():
        backend = {"cuda": "nccl", "npu": "hccl"}.get(device_type, "gloo")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
        else:  # alone: a group of one, its store in this process
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _made = True
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))


def release_group() -> None:
    """Destroy the default group if init_group made it, once every rank is done with it.
    Left to the interpreter's exit, gloo's worker threads can outlive the group's Python
    side and abort the process (`terminate called without an active exception`)."""
    global _made
    if _made and dist.is_initialized():
        dist.destroy_process_group()
    _made = False


def rank_backend(backend: Backend) -> Backend:
    """The backend on this rank's device (torchrun: cuda:LOCAL_RANK), one GPU per process."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend.device.type == "cuda" and backend.device.index != local:
        torch.cuda.set_device(local)
        return type(backend)()  # a backend object on this rank's device
    return backend


def config(model: str) -> Qwen3Config:
    return qwen3_8b() if model == "qwen3-8b" else Qwen3Config.named(model)


def workloads(
    backend: Backend,
    model: str,
    group: Any,
    max_seqs: int,
    context: int,
    dtype: torch.dtype | None = None,
) -> tuple[Workload, Workload]:
    """(this rank's TP shard, the single-rank model) with caches for `max_seqs` sequences,
    the TP cache filled with seeded values (the context decode steps attend over).

    Random weights: the TP shard is a slice of the single-rank model's seeded weights, except
    for the 8B-class shape, where each draws its own on the device (only shapes matter; over
    a group of one both draw the same). `dtype`: float32 on the CPU, bf16 elsewhere."""
    dev = backend.device
    dtype = dtype or (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    c = config(model)
    blocks = max_seqs * -(-context // 16)
    big = model == "qwen3-8b"
    kw = dict(num_blocks=blocks, block_size=16, dtype=dtype, device=dev)
    tp = Qwen3TPModel.build(c, group, random_shards=big, **kw)
    one = (
        Qwen3TPModel.build(c, None, random_shards=True, **kw) if big else Qwen3Model.build(c, **kw)
    )
    w = Workload(tp, -(-context // 16), max_seqs)
    fill_cache(w, 0)
    return w, Workload(one, -(-context // 16), max_seqs)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Outputs against eager: bit for bit in float32 on the CPU; elsewhere the error's norm
    relative to the reference's, at most 1e-2 (two bf16 kernel paths differ by their
    rounding, element by element by more than a max-abs bound can allow). The MoE check's;
    the TP rows hold the float32 criterion (distributed_fidelity)."""
    diff = (out.float() - ref.float()).abs()
    if out.dtype == torch.float32 and out.device.type == "cpu":
        return {"max_abs_diff": float(diff.max()), "equal": bool(diff.max() == 0)}
    rel = float(diff.norm() / ref.float().norm().clamp_min(1e-30))
    return {"max_abs_diff": float(diff.max()), "rel_norm_diff": rel, "equal": rel <= 1e-2}


def agreement_us(ex: Any, step: Any, iters: int) -> float:
    """Host microseconds of one step's agreement (the exchange and the rule), median; every
    rank runs as many. A group of one exchanges nothing per step: its number is the same
    exchange on a one-rank side group, the mechanism's own host cost."""
    lock = ex.lockstep
    checked = lock.planner.check(_inputs(step), step.attn)
    local = lock.planner.decide(checked)
    if lock.channel is not None:
        return host_time(ex.backend, lambda: lock.agree(checked, local), iters) * 1e6
    ch = Channel(lock.parallel.ranks, lock.parallel.timeout)
    dims, comm = lock.dims, lock.comm

    def agree() -> None:
        msg = message(OK, checked, local, dims, Stamp())
        decide(ch.exchange(msg, "step agreement"), dims, comm)

    return host_time(ex.backend, agree, iters) * 1e6


def _inputs(step: Any) -> dict[str, torch.Tensor]:
    return {"input_ids": step.input_ids, "positions": step.positions}


def decode_rows(
    backend: Backend, w: Workload, w1: Workload, par: Any, batches: list[int], iters: int
) -> list[dict[str, Any]]:
    """Per batch: the TP executor's output against float32, eager, the hand-captured graph
    and the single-rank executor; its step time, the agreement's, the single-rank anchor's
    and the hand-captured graph's; then graph memory."""
    ex = w.executor(backend=backend, buckets=batches, parallel=par, name="tp")
    ex1 = w1.executor(backend=backend, buckets=batches, name="tp1")
    fid = Fidelity(w, w1, dist.get_world_size())
    rows = []
    rng = random.Random(0)  # the same steps on every rank: TP ranks run one batch
    for b in batches:
        step = w.decode_step(rng, b, max_context=256)
        row = _decode_row(backend, (ex, ex1), fid, step, iters)
        rows.append(row)
        note(f"rank {dist.get_rank()}: decode batch {b}: {row}")
    st = ex.stats()
    manifests = st["parallel"]["manifests"]
    row_stats = {"graph_bytes": st["graph_bytes"], "keys": len(st["keys"])}
    row_stats["manifest"] = next(iter(manifests.values()), [])  # the first key's collectives
    rows.append({"memory": row_stats, "group": xdist.group_stats(ex)})
    ex.close()
    ex1.close()
    return rows


def _decode_row(
    backend: Backend, executors: tuple[Any, Any], fid: Fidelity, step: Any, iters: int
) -> dict[str, Any]:
    ex, ex1 = executors
    w, timer, kw, b = fid.w, Timer(backend), step.kwargs(), step.num_tokens
    row: dict[str, Any] = {"batch": b}
    fid.start()  # the single-rank cache: the TP cache's values
    out = ex(**kw, clone=True)
    single = ex1(**kw, clone=True)[:b] if fid.single is not None else None
    padded = w.padded(step, Buckets(ex.buckets.sizes), full=True)
    eager = w.eager(padded)[:b]
    hand: dict[str, Any] = {}
    attempt(row, "raw", lambda: _raw(backend, w, step, timer, iters, hand))
    fp32 = fid.fp32(padded)
    fp32 = fp32[:b] if fp32 is not None else None
    row.update(fid.row(out, eager, fp32=fp32, hand=hand.get("out"), single=single))
    row["step_ms"] = timer(lambda: ex(**kw), iters) * 1e3
    row["agree_us"] = agreement_us(ex, step, iters)
    ex1(**kw)
    row["tp1_ms"] = timer(lambda: ex1(**kw), iters) * 1e3
    return row


def _raw(
    backend: Backend, w: Workload, step: Any, timer: Timer, iters: int, keep: dict[str, Any]
) -> dict | None:
    """The TP forward captured by hand (CUDA: torch.cuda.graph in thread-local mode, as
    NCCL needs; elsewhere the backend's own graph API), replayed on its static inputs;
    keep["out"]: its logits after one replay."""
    ids, pos, ctx, _ = static_inputs(backend, w, step)
    box: dict[str, torch.Tensor] = {}

    def forward() -> None:
        with torch.no_grad(), step_context(ctx):
            box["out"] = w.model.forward_logits(ids, pos)

    cuda = backend.device.type == "cuda"
    replay = hand_graph(forward) if cuda else hooks.native_graph(backend, forward)
    if replay is None:
        return None
    replay()
    keep["out"] = box["out"][: step.num_tokens].clone()
    return {"raw_ms": timer(replay, iters) * 1e3}


def hand_graph(fn: Any) -> Any:
    """`fn` warmed up on a side stream, then captured with torch.cuda.graph (thread-local)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    return g.replay


def prefill_rows(
    backend: Backend,
    w: Workload,
    par: Any,
    sizes: list[int],
    iters: int,
    w1: Workload | None = None,
) -> list[dict[str, Any]]:
    """Piecewise prefill through the executor: output against float32, eager and (over a
    group of one, given `w1`) the single-rank executor; step time."""
    buckets = sorted(set(sizes))
    ex = w.executor(backend=backend, buckets=buckets, parallel=par, mode="piecewise", name="pp")
    fid = Fidelity(w, w1, dist.get_world_size())
    ex1 = None
    if fid.single is not None:
        ex1 = fid.single.executor(backend=backend, buckets=buckets, mode="piecewise", name="pp1")
    timer, rng = Timer(backend), random.Random(1)
    rows = [
        _prefill_row((ex, ex1), fid, timer, w.prefill_step(rng, [n - n // 2, n // 2]), iters)
        for n in sizes
    ]
    ex.close()
    if ex1 is not None:
        ex1.close()
    return rows


def _prefill_row(
    executors: tuple[Any, Any], fid: Fidelity, timer: Timer, step: Any, iters: int
) -> dict[str, Any]:
    (ex, ex1), w = executors, fid.w
    n, kw = step.num_tokens, step.kwargs()
    fid.start()
    out = ex(**kw, clone=True)
    single = ex1(**kw, clone=True) if ex1 is not None else None
    padded = w.padded(step, Buckets(ex.buckets.sizes), full=False)
    eager = w.eager(padded, PagedPrefillRunner(), num_tokens=n)[:n]
    fp32 = fid.fp32(padded, PagedPrefillRunner(), num_tokens=n)
    fp32 = fp32[:n] if fp32 is not None else None
    row = {"tokens": n, **fid.row(out, eager, fp32=fp32, single=single)}
    row["step_ms"] = timer(lambda: ex(**kw), max(3, iters // 5)) * 1e3
    return row


def run(
    backend: Backend, model: str, batches: list[int] | None, iters: int, prefill: list[int] | None
) -> dict[str, Any]:
    rank, world, _ = init_group(backend.device.type)
    backend = rank_backend(backend)
    accel = backend.device.type != "cpu"
    batches = batches or ([1, 8, 64] if accel else [1, 4])
    prefill = prefill or ([128, 512] if accel else [16])
    group = dist.group.WORLD
    par = xdist.Parallel(tp=group, timeout=120)
    w, w1 = workloads(backend, model, group, max(batches), 512 if accel else 64)
    mine = {"rank": rank, "device": hooks.device_name(backend)}
    mine["decode"] = decode_rows(backend, w, w1, par, batches, iters)
    mine["prefill"] = prefill_rows(backend, w, par, prefill, iters, w1)
    everyone = par.channel.gather_objects(mine, "bench results") if par.channel else [mine]
    par.close()
    return {
        "backend": backend.name,
        "model": model,
        "world_size": world,
        "timing": f"device time ({hooks.device_name(backend)})" if accel else Timer(backend).unit,
        "ranks": everyone,
        "mismatches": sum(
            not r.get("equal", True) for m in everyone for r in m["decode"] + m["prefill"]
        ),
    }


def summarize(data: dict[str, Any]) -> str:
    cols = ["rank", "batch", "step_ms", "tp1_ms", "raw_ms", "agree_us", "equal"]
    cols += ["exec_vs_fp32", "eager_vs_fp32", "hand_vs_fp32", "exec_vs_eager"]
    rows = [{"rank": m["rank"], **r} for m in data["ranks"] for r in m["decode"] if "batch" in r]
    mem = [
        {"rank": m["rank"], **r["memory"]}
        for m in data["ranks"]
        for r in m["decode"]
        if "memory" in r
    ]
    pre = [{"rank": m["rank"], **r} for m in data["ranks"] for r in m["prefill"]]
    return (
        f"{data['backend']} / {data['model']}, TP={data['world_size']}; {data['timing']}; "
        "step: executor step (agreement included); tp1: the single-rank model on one device; "
        "raw: the TP forward captured with the runtime's graph API; agree_us: the agreement "
        "alone (host)\n\n"
        + table(rows, cols)
        + "\n\npiecewise prefill\n\n"
        + table(pre, ["rank", "tokens", "step_ms", "equal", "exec_vs_fp32", "eager_vs_fp32"])
        + "\n\ngraph memory per rank\n\n"
        + table(mem, ["rank", "graph_bytes", "keys"])
    )
