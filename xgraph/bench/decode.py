"""`xgraph bench decode`: decode step time against the anchors, and executor host overhead.

Side by side in one process, per batch size: eager, raw torch.cuda.CUDAGraph over static
buffers in a shared pool (the hand-written anchor), torch.compile(mode="reduce-overhead")
(optional, slow to compile), and the GraphExecutor step (staging + replay). Times are
medians of device-event timings. Host overhead: host wall time of one executor step minus
that of the raw graph's replay() call, each measured with an idle device (synchronized
before the call) so neither waits on earlier work.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from ..attention import AttentionMetadata, InlineRunner, step_context
from ..interfaces import Backend
from .common import Timer, header, table, workload


def _host_time(backend: Backend, fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    ts = []
    for _ in range(iters):
        backend.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    backend.synchronize()
    return statistics.median(ts)


def _static_metadata(w, step) -> AttentionMetadata:  # type: ignore[no-untyped-def]
    """The step's metadata with block tables as wide as the executor's (the same work)."""
    dev = w.cache.tensors()[0].device
    a = step.attn
    rows = [list(r) + [w.cache.dummy_block] * (w.max_blocks - len(r)) for r in a.block_tables]
    return AttentionMetadata.build(a.query_lens, a.seq_lens, rows, a.slot_mapping, dev)


def _raw_graph(w, step, runner):  # type: ignore[no-untyped-def]
    """The anchor: the forward captured by hand with torch.cuda.graph on static tensors."""
    dev = w.cache.tensors()[0].device
    ids, pos = step.input_ids.to(dev), step.positions.to(dev)
    md = _static_metadata(w, step)
    runner.plan(md)
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad(), step_context(InlineRunner(runner)):
        for _ in range(2):
            w.model.forward(ids, pos)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), step_context(InlineRunner(runner)), torch.cuda.graph(g, pool=pool):
        out = w.model.forward(ids, pos)
    return g, out


def run(
    backend: Backend,
    model: str = "tiny",
    batches: list[int] | None = None,
    iters: int = 50,
    compile_batches: list[int] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    cuda = backend.device.type == "cuda"
    batches = batches or ([1, 8, 64, 256] if cuda else [1, 8, 32])
    w = workload(backend, model, max_seqs=max(batches), context=512 if cuda else 64)
    timer = Timer(backend)
    rng = random.Random(seed)
    ex = w.executor(w.model.forward, backend=backend, buckets=batches)
    eager = w.executor(w.model.forward, backend=backend, buckets=batches, mode="eager")
    rows = []
    for b in batches:
        step = w.decode_step(rng, b, max_context=256 if cuda else 64).with_tensor_tables(
            w.max_blocks, w.cache.dummy_block)
        row: dict[str, Any] = {"batch": b}
        row["eager_s"] = timer(lambda step=step: eager(**step.kwargs()), iters)
        row["xgraph_s"] = timer(lambda step=step: ex(**step.kwargs()), iters)
        row["xgraph_host_s"] = _host_time(backend, lambda step=step: ex(**step.kwargs()), iters)
        if cuda:
            from ..attention import PagedDecodeRunner

            g, _ = _raw_graph(w, step, PagedDecodeRunner())
            row["raw_graph_s"] = timer(g.replay, iters)
            row["raw_replay_host_s"] = _host_time(backend, g.replay, iters)
            row["host_overhead_s"] = row["xgraph_host_s"] - row["raw_replay_host_s"]
            row["xgraph/raw_graph"] = row["xgraph_s"] / row["raw_graph_s"]
            del g
        row["eager/xgraph"] = row["eager_s"] / row["xgraph_s"]
        if cuda and compile_batches and b in compile_batches:
            row.update(_compiled(w, step, timer, iters))
        rows.append(row)
    ex.close()
    eager.close()
    return {
        **header(backend, model, w),
        "timing": timer.unit,
        "rows": rows,
    }


def _compiled(w, step, timer: Timer, iters: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """torch.compile(mode='reduce-overhead') of the same forward with the decode runner."""
    from ..attention import PagedDecodeRunner

    dev = w.cache.tensors()[0].device
    a = step.attn
    runner = PagedDecodeRunner()
    runner.plan(
        AttentionMetadata.build(a.query_lens, a.seq_lens, a.block_tables, a.slot_mapping, dev)
    )
    ids, pos = step.input_ids.to(dev), step.positions.to(dev)
    ctx = InlineRunner(runner)

    def fwd(ids, pos):  # type: ignore[no-untyped-def]
        with step_context(ctx):
            return w.model.forward(ids, pos)

    try:
        t0 = time.perf_counter()
        compiled = torch.compile(fwd, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):
                compiled(ids, pos)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0

        def call():  # type: ignore[no-untyped-def]
            with torch.no_grad():
                compiled(ids, pos)

        return {"compile_s": timer(call, iters), "compile_warmup_s": compile_s}
    except Exception as exc:  # the anchor failing must not hide the other numbers
        return {"compile_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def summarize(data: dict[str, Any]) -> str:
    rows = []
    for r in data["rows"]:
        row = {
            "batch": r["batch"],
            "eager ms": r["eager_s"] * 1e3,
            "xgraph ms": r["xgraph_s"] * 1e3,
            "eager/xgraph": r["eager/xgraph"],
        }
        if "raw_graph_s" in r:
            row.update(
                {
                    "raw graph ms": r["raw_graph_s"] * 1e3,
                    "xgraph/raw graph": r["xgraph/raw_graph"],
                    "host us/step": r["xgraph_host_s"] * 1e6,
                    "raw replay host us": r["raw_replay_host_s"] * 1e6,
                    "overhead us": r["host_overhead_s"] * 1e6,
                }
            )
        if "compile_s" in r:
            row["compile(reduce-overhead) ms"] = r["compile_s"] * 1e3
        elif "compile_error" in r:
            row["compile(reduce-overhead) ms"] = "failed"
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return (
        f"{data['backend']} / {data['device']} / {data['model']} ({data['dtype']}); "
        f"times: median {data['timing']}\n\n" + table(rows, cols)
    )
