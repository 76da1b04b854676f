"""`xgraph bench decode`: decode step time against the anchors, and executor host overhead.

Side by side in one process, per batch size: eager, the GraphExecutor step (staging +
replay), the forward captured by hand with the runtime's own graph API on static buffers
(`backend.native_graph`; absent where the backend has none) and, optionally on
accelerators (`--compile` batch sizes), torch.compile(mode="reduce-overhead") and the
executor over a torch.compile'd forward (Inductor kernels, xgraph's graphs), both slow to
compile. Times are medians of
device timings where the backend has a device timer. Host overhead: host wall time of one
executor step minus that of the native graph's replay call, each measured with an idle
device (synchronized before the call) so neither waits on earlier work.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from ..attention import InlineRunner, step_context
from ..executor import GraphExecutor
from ..interfaces import AttentionRunner, Backend
from ..metadata import AttentionMetadata
from ..models import Step, Workload
from ..runners import reference_runners
from .report import header, table, workload
from .timing import Timer, host_time


def _static_metadata(w: Workload, step: Step) -> AttentionMetadata:
    """The step's metadata with block tables as wide as the executor's (the same work)."""
    dev = w.cache.tensors()[0].device
    wide = step.with_tensor_tables(w.max_blocks, w.cache.dummy_block)
    return wide.attn.metadata(dev, fill_block=w.cache.dummy_block)


def _decode_runner(backend: Backend) -> AttentionRunner:
    """A fresh decode runner of the kind the executor picks, so the anchors run the same forward."""
    return {**reference_runners(), **backend.attention_runners()}["decode"]


def _static_inputs(
    backend: Backend, w: Workload, step: Step
) -> tuple[torch.Tensor, torch.Tensor, InlineRunner]:
    """Device token inputs and a runner planned on the step: the anchors' static buffers."""
    dev = w.cache.tensors()[0].device
    runner = _decode_runner(backend)
    runner.plan(_static_metadata(w, step))
    return step.input_ids.to(dev), step.positions.to(dev), InlineRunner(runner)


def _native_anchor(backend: Backend, w: Workload, step: Step) -> Callable[[], None] | None:
    """The forward captured with the runtime's own graph API (a replay callable), or None."""
    ids, pos, ctx = _static_inputs(backend, w, step)

    def forward() -> None:
        with torch.no_grad(), step_context(ctx):
            w.model.forward(ids, pos)

    return backend.native_graph(forward)


def _compiled(
    backend: Backend, w: Workload, step: Step, timer: Timer, iters: int
) -> dict[str, Any]:
    """torch.compile(mode='reduce-overhead') of the same forward with the decode runner."""
    ids, pos, ctx = _static_inputs(backend, w, step)

    def fwd(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with step_context(ctx):
            return w.model.forward(ids, pos)

    try:
        t0 = time.perf_counter()
        compiled = torch.compile(fwd, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):
                compiled(ids, pos)
        backend.synchronize()
        compile_s = time.perf_counter() - t0

        def call() -> None:
            with torch.no_grad():
                compiled(ids, pos)

        return {"compile_s": timer(call, iters), "compile_warmup_s": compile_s}
    except Exception as exc:  # the anchor failing must not hide the other numbers
        return {"compile_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _xgraph_compiled(
    backend: Backend, w: Workload, step: Step, timer: Timer, iters: int
) -> dict[str, Any]:
    """The executor over the reference model with its layers torch.compile'd (Inductor, no
    graphs of its own): the compiled kernels captured and replayed by xgraph; first step =
    compile + capture. A second copy of the model is compiled, so the other rows keep the
    eager kernels."""
    try:
        cw = Workload(copy.deepcopy(w.model).compile_layers(), w.max_blocks, w.max_seqs)
        ex = cw.executor(cw.model.forward, backend=backend, buckets=[step.num_tokens],
                         compiled=True)  # fmt: skip
        t0 = time.perf_counter()
        ex(**step.kwargs())
        backend.synchronize()
        first = time.perf_counter() - t0
        row = {
            "xgraph_compiled_s": timer(lambda: ex(**step.kwargs()), iters),
            "xgraph_compiled_first_step_s": first,
            "xgraph_compiled_capture_s": ex.stats()["capture_seconds"],
        }
        ex.close()
        return row
    except Exception as exc:  # a compiler failure must not hide the other numbers
        return {"xgraph_compiled_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _measure(
    backend: Backend,
    w: Workload,
    step: Step,
    executors: tuple[GraphExecutor, GraphExecutor],
    timer: Timer,
    iters: int,
) -> dict[str, Any]:
    """One batch's times: eager and executor, then the native-graph anchor where there is one."""
    ex, eager = executors
    row: dict[str, Any] = {
        "eager_s": timer(lambda: eager(**step.kwargs()), iters),
        "xgraph_s": timer(lambda: ex(**step.kwargs()), iters),
        "xgraph_host_s": host_time(backend, lambda: ex(**step.kwargs()), iters),
    }
    replay = _native_anchor(backend, w, step)
    if replay is not None:
        row["raw_graph_s"] = timer(replay, iters)
        row["raw_replay_host_s"] = host_time(backend, replay, iters)
        row["host_overhead_s"] = row["xgraph_host_s"] - row["raw_replay_host_s"]
        row["xgraph/raw_graph"] = row["xgraph_s"] / row["raw_graph_s"]
        del replay  # the anchor's graph and its pool go before the next batch's
    row["eager/xgraph"] = row["eager_s"] / row["xgraph_s"]
    return row


def run(
    backend: Backend,
    model: str = "tiny",
    batches: list[int] | None = None,
    iters: int = 50,
    compile_batches: list[int] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    accel = backend.device.type != "cpu"
    batches = batches or ([1, 8, 64, 256] if accel else [1, 8, 32])
    w = workload(backend, model, max_seqs=max(batches), context=512 if accel else 64)
    timer = Timer(backend)
    rng = random.Random(seed)
    ex = w.executor(w.model.forward, backend=backend, buckets=batches)
    eager = w.executor(w.model.forward, backend=backend, buckets=batches, mode="eager")
    rows = []
    for b in batches:
        step = w.decode_step(rng, b, max_context=256 if accel else 64).with_tensor_tables(
            w.max_blocks, w.cache.dummy_block
        )
        row = {"batch": b, **_measure(backend, w, step, (ex, eager), timer, iters)}
        # torch.compile's reduce-overhead mode is a graph runtime of its own: accelerators only
        if accel and compile_batches and b in compile_batches:
            row.update(_compiled(backend, w, step, timer, iters))
            row.update(_xgraph_compiled(backend, w, step, timer, iters))
        rows.append(row)
    ex.close()
    eager.close()
    return {**header(backend, model, w), "timing": timer.unit, "rows": rows}


def summarize(data: dict[str, Any]) -> str:
    rows = []
    for r in data["rows"]:
        row = {
            "batch": r["batch"],
            "eager ms": r["eager_s"] * 1e3,
            "xgraph ms": r["xgraph_s"] * 1e3,
            "eager/xgraph": r["eager/xgraph"],
        }
        if "raw_graph_s" in r:  # only where the backend has a native graph API
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
        if "xgraph_compiled_s" in r:
            row["xgraph over compile ms"] = r["xgraph_compiled_s"] * 1e3
            row["compile+capture s"] = r["xgraph_compiled_first_step_s"]
        elif "xgraph_compiled_error" in r:
            row["xgraph over compile ms"] = "failed"
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return (
        f"{data['backend']} / {data['device']} / {data['model']} ({data['dtype']}); "
        f"times: median {data['timing']}\n\n" + table(rows, cols)
    )
