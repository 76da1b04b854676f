"""`xgraph bench decode`: decode step time against the anchors, the roofline, host overhead.

Side by side in one process, per batch size: eager, the GraphExecutor step (staging +
replay) over the eager forward, the forward captured by hand with the runtime's own graph
API on static buffers (`backend.native_graph`; absent where the backend has none) and, for
the `--compile` batch sizes (default 1, 8, 64 on accelerators), torch.compile(mode=
"reduce-overhead") of the forward and the executor over the forward with its layers
compiled (Inductor's kernels, xgraph's graphs). The compiled variants are built once and
reused by every batch size; they run after every other measurement, so a slow or failing
compile cannot cost the rest. Times are medians of device timings where the backend has a
device timer (the device's work only: the host's time to queue it is kept out); eager rows
also give the host's wall time per step, queueing included (`eager wall`).

The reduce-overhead anchor runs torch's own kernels (`anchor_kernels="torch"`, the
default: what torch.compile gives a model without xgraph; the backend's projection kernels
are uninstalled around its compiles and calls), or, with "xgraph", the backend's kernels
inside torch's graphs. On devices the profiler traces, each of xgraph, xgraph over compile
and reduce-overhead is also traced over a few steps (`profile`: kernels per step, busy and
span, idle share) and sampled for its distance from a float32 reference of the same weights
(`fidelity`, per batch; `probes`).

Each step time is also set against the memory roofline (`roofline`): the weight bytes a step
reads over the bandwidth of the device measured in the same run. Per batch, the best
executor row (eager or compiled forward) is divided by each anchor (reduce-overhead, raw
graph). Host overhead: host wall time of one executor step minus that of the native
graph's replay call, each with an idle device (synchronized before the call), the median of
at least `HOST_ITERS` calls on an accelerator, the two calls taken in turn in one loop (a
lent host's speed drifts between phases of a process: the same row measured apart read 59
and 194 us on one H100), every batch's taken before any kernel trace (a trace leaves every
later launch of the process slower).
`--table-check BATCH` adds the context-width check (`table_check`).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

import torch

from .. import linear as core_linear
from ..attention import step_context
from ..executor import GraphExecutor
from ..interfaces import Backend
from ..models import Step, Workload
from . import roofline, table_check
from .anchors import (
    ReduceOverhead,
    as_step,
    compiled_twin,
    first_step,
    native_anchor,
    static_inputs,
)
from .decode_report import ANCHORS, VARIANTS, XGRAPH, summarize  # noqa: F401 (summarize)
from .probes import Probes, fidelity_gate
from .report import attempt, header, note, workload
from .timing import Timer, host_time, host_times, wall_time

DEFAULT_COMPILE = [1, 8, 64]  # --compile's default on accelerators
COMPILE_BUCKETS = ("one", "per-size", "both", "none")  # --compile-buckets
ANCHOR_KERNELS = ("torch", "xgraph")  # the reduce-overhead anchor's kernels
# an accelerator's host times are medians of at least this many calls: one costs a
# synchronize and a step's queueing, and the lent hosts' speed wanders, so thirty left the
# overhead to chance (on the CPU a call is the whole step: `iters` as asked)
HOST_ITERS = 200


def host_iters(backend: Backend, iters: int) -> int:
    return iters if backend.device.type == "cpu" else max(iters, HOST_ITERS)


def _raw_graph(
    backend: Backend,
    w: Workload,
    step: Step,
    timer: Timer,
    iters: int,
    executor_step: Callable[[], Any] | None,
) -> dict:
    """The native graph's times, and the host times of its replay and of the executor's
    step (None: the executor's row failed) taken in turn in one loop (the module doc says
    why)."""
    anchor = native_anchor(backend, w, step)
    if anchor is None:  # the runtime has no graph API of its own
        return {}
    replay, send = anchor
    # the anchor's graph and its pool go when `replay` does, before the next batch's
    calls = {"raw": replay} if executor_step is None else {"xgraph": executor_step, "raw": replay}
    host = host_times(backend, calls, host_iters(backend, iters))
    return {
        "raw_graph_s": timer(replay, iters),
        "raw_graph_inputs_s": timer(as_step(send, replay), iters),
        "raw_replay_host_s": host["raw"],
    } | ({"xgraph_host_s": host["xgraph"]} if "xgraph" in host else {})


def _measure(
    backend: Backend,
    w: Workload,
    step: Step,
    executors: tuple[GraphExecutor, GraphExecutor],
    timer: Timer,
    iters: int,
    row: dict[str, Any],
) -> None:
    """Eager, executor and native-graph times of one batch, each isolated from the others."""
    ex, eager = executors

    def run() -> Any:
        return ex(**step.kwargs())

    attempt(
        row,
        "eager",
        lambda: {
            "eager_s": timer(lambda: eager(**step.kwargs()), iters),
            "eager_wall_s": wall_time(backend, lambda: eager(**step.kwargs()), iters),
        },
    )
    ran = run if attempt(row, "xgraph", lambda: {"xgraph_s": timer(run, iters)}) else None
    attempt(row, "raw_graph", lambda: _raw_graph(backend, w, step, timer, iters, ran))
    if ran is not None and "xgraph_host_s" not in row:  # no native graph to take it beside
        attempt(
            row,
            "xgraph",
            lambda: {"xgraph_host_s": host_time(backend, run, host_iters(backend, iters))},
        )
    if "xgraph_host_s" in row and "raw_replay_host_s" in row:
        row["host_overhead_s"] = row["xgraph_host_s"] - row["raw_replay_host_s"]


class _Compiled:
    """The compiled variants, each built at its first use and reused by later batches:
    one reduce-overhead function; the compiled twin of the model behind one executor,
    compiled once for every batch size (`buckets="one"`), once per batch size
    ("per-size"), or both, each behind its own executor."""

    def __init__(
        self,
        backend: Backend,
        w: Workload,
        batches: list[int],
        compiler: str,
        scope: str = "layers",
        buckets: str = "one",
        anchor_kernels: str = "torch",
    ) -> None:
        if anchor_kernels not in ANCHOR_KERNELS:
            raise ValueError(f"anchor kernels {anchor_kernels!r}: choose one of {ANCHOR_KERNELS}")
        self.stock = anchor_kernels == "torch"
        if buckets not in COMPILE_BUCKETS:
            raise ValueError(f"compile buckets {buckets!r}: choose one of {COMPILE_BUCKETS}")
        self.backend, self.w, self.batches, self.compiler = backend, w, batches, compiler
        self.scope, self.buckets = scope, buckets
        self.ro: ReduceOverhead | None = None
        self.twin: Workload | None = None
        self.executors: dict[str, GraphExecutor] = {}

    def _anchor_kernels(self) -> Any:
        """Where the anchor runs torch's own kernels: none of the backend's installed."""
        if self.stock:
            return core_linear.kernels_off(self.backend.device.type)
        return contextlib.nullcontext()

    def reduce_overhead(self, step: Step, timer: Timer, iters: int) -> dict[str, Any]:
        with self._anchor_kernels():
            if self.ro is None:
                self.ro = ReduceOverhead(self.backend, self.w.model, self.compiler)
            return self.ro.measure(self.w, step, timer, iters)

    def reduce_overhead_step(self, step: Step) -> Callable[[], Any]:
        """One reduce-overhead call on the step's static inputs (compiled by `measure`)."""
        assert self.ro is not None
        fn = self.ro.fn
        ids, pos, ctx, _ = static_inputs(self.backend, self.w, step)

        def call() -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            with self._anchor_kernels(), torch.no_grad(), step_context(ctx):
                return fn(ids, pos)

        return call

    def _executor(self, key: str) -> GraphExecutor:
        """The executor over the twin compiled for `key` ("one": the token count dynamic, a
        compile for every batch size; "per-size": static shapes, a compile per size)."""
        if key not in self.executors:
            model = compiled_twin(
                self.w.model,
                self.compiler,
                dynamic=key == "one",
                scope=self.scope,
                max_tokens=max(self.batches),
            )
            twin = Workload(model, self.w.max_blocks, self.w.max_seqs)
            if key == "one" or self.twin is None:
                self.twin = twin  # the width check runs over the one-compile twin
            ex = twin.executor(
                model.forward,
                backend=self.backend,
                buckets=self.batches,
                compiled=True,
                on_capture_error="raise",
            )
            self.executors[key] = ex
        return self.executors[key]

    def xgraph(self, step: Step, timer: Timer, iters: int, key: str) -> dict[str, Any]:
        ex = self._executor(key)
        name = "xgraph_compiled" if key == "one" else "xgraph_per_size"
        before = ex.stats()["capture_seconds"]
        first = first_step(self.backend, lambda: ex(**step.kwargs()))
        out = {
            f"{name}_s": timer(lambda: ex(**step.kwargs()), iters),
            f"{name}_first_step_s": first,  # compile (first sizes only) + capture
            f"{name}_capture_s": ex.stats()["capture_seconds"] - before,
        }
        forward = ex.forward
        if hasattr(forward, "compiles"):  # TokenCompiled: graphs compiled so far
            out[f"{name}_compiles"] = forward.compiles
        return out

    def keys(self) -> list[str]:
        if self.buckets == "none":  # reduce-overhead alone: a shorter run (decode-limit)
            return []
        return ["one", "per-size"] if self.buckets == "both" else [self.buckets]

    def close(self) -> None:
        for ex in self.executors.values():
            ex.close()


def _finish(row: dict[str, Any], weights: int, bw: float | None) -> None:
    """Roofline fields and the ratios between rows, from whatever was measured."""
    roofline.fill(row, VARIANTS, weights, bw)
    t = {name: row[key] for name, key in VARIANTS.items() if row.get(key)}
    if "eager" in t and "xgraph" in t:
        row["eager/xgraph"] = t["eager"] / t["xgraph"]
    if "xgraph" in t and "raw graph" in t:
        row["xgraph/raw_graph"] = t["xgraph"] / t["raw graph"]
    best = min((n for n in XGRAPH if n in t), key=lambda n: t[n], default=None)
    if best is not None:
        row["best_xgraph"], row["best_xgraph_s"] = best, t[best]
        row["best_xgraph_vs"] = {a: t[best] / t[a] for a in ANCHORS if a in t}
    gate = fidelity_gate(row, best)
    if gate is not None:
        row["fidelity_gate"] = gate


def _workload(
    backend: Backend, model: str, batches: list[int], check: int | None, accel: bool
) -> Workload:
    """Tables 512 tokens wide for the batches; cache blocks for the width check too."""
    seqs = max(batches + ([check] if check else []))
    blocks = table_check.blocks_needed(check, 16) if check else None
    return workload(backend, model, max_seqs=seqs, context=512 if accel else 64, num_blocks=blocks)


def _progress(row: dict[str, Any]) -> None:
    times = ", ".join(f"{n} {row[k] * 1e3:.3f} ms" for n, k in VARIANTS.items() if k in row)
    note(f"decode batch {row['batch']}: {times}")


def _compiled_rows(
    compiled: _Compiled,
    data: dict[str, Any],
    steps: dict[int, Step],
    timer: Timer,
    iters: int,
    save: Callable[[], None],
    probes: Probes,
) -> None:
    """The compiled variants of each --compile batch, then the width check over the
    compiled twin (if the run has a check and the twin was built)."""
    rows = {r["batch"]: r for r in data["rows"]}
    for b in compiled.batches:
        step, row = steps[b], rows[b]
        attempt(row, "reduce_overhead", lambda s=step: compiled.reduce_overhead(s, timer, iters))
        if "reduce_overhead_s" in row:
            probes.observe(row, "reduce-overhead", step, compiled.reduce_overhead_step(step))
        for key in compiled.keys():
            name = "xgraph_compiled" if key == "one" else "xgraph_per_size"
            attempt(row, name, lambda s=step, k=key: compiled.xgraph(s, timer, iters, k))
            if key == "one" and f"{name}_s" in row:
                ex = compiled.executors[key]
                call = lambda e=ex, s=step: e(**s.kwargs())  # noqa: E731
                probes.observe(row, "xgraph over compile", step, call)
        _progress(row)
        save()
    compiled.close()
    if "table_check" in data and compiled.twin is not None:
        table_check.run(
            compiled.backend,
            data["table_check"],
            "xgraph_compiled",
            compiled.twin.model,
            timer,
            iters,
        )
        save()


def _steps(w: Any, batches: list[int], seed: int, accel: bool) -> dict[int, Any]:
    """One random decode step per batch size, with tensor block tables as engines keep them."""
    rng = random.Random(seed)
    return {
        b: w.decode_step(rng, b, max_context=256 if accel else 64).with_tensor_tables(
            w.max_blocks, w.cache.dummy_block
        )
        for b in batches
    }


def run(
    backend: Backend,
    model: str = "tiny",
    batches: list[int] | None = None,
    iters: int = 50,
    compile_batches: list[int] | None = None,
    table_check_batch: int | None = None,
    seed: int = 0,
    compiler: str = "inductor",
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
    compile_scope: str = "layers",
    compile_buckets: str = "one",
    anchor_kernels: str = "torch",
    probe: bool = True,
) -> dict[str, Any]:
    """Every row, then the width check, then the compiled rows, then the fidelity of what was
    sampled; `checkpoint` gets the data so far after each stage (a run stopped by a time
    limit keeps what it measured). `compile_scope`: what the executor's compiled forward
    compiles ("layers": each layer; "forward": the whole forward as one graph).
    `compile_buckets`: "one" compile for every batch size, "per-size", or "both" (two rows).
    `anchor_kernels`: the reduce-overhead anchor's ("torch": torch's own; "xgraph": the
    backend's). `probe`: trace kernels and sample fidelity (`probes`)."""
    accel = backend.device.type != "cpu"
    batches = batches or ([1, 8, 64, 256] if accel else [1, 8, 32])
    if compile_batches is None:
        compile_batches = DEFAULT_COMPILE if accel else []
    w = _workload(backend, model, batches, table_check_batch, accel)
    timer = Timer(backend)
    settings = {"iters": iters, "compile_scope": compile_scope}
    settings.update(compile_buckets=compile_buckets, anchor_kernels=anchor_kernels)
    data = {**header(backend, model, w), **settings}
    data["weight_bytes"] = roofline.weight_bytes(w.model)
    attempt(data, "bandwidth", lambda: roofline.bandwidth(backend, timer))

    def snapshot() -> dict[str, Any]:
        for r in data["rows"]:  # derived fields, recomputed from what is measured so far
            _finish(r, data["weight_bytes"], data.get("bandwidth_bytes_per_s"))
        return {**data, "timing": timer.unit}

    def save() -> None:
        if checkpoint is not None:
            checkpoint(snapshot())

    steps = _steps(w, batches, seed, accel)
    rows = {b: {"batch": b, "kv_bytes": roofline.kv_bytes(w.cache, steps[b])} for b in batches}
    data["rows"] = list(rows.values())
    probes = Probes(backend, w, probe)
    _eager_rows(backend, w, steps, rows, timer, iters, save, probes)
    if table_check_batch:  # the eager forward's part now, the compiled one's with its rows
        data["table_check"] = check = table_check.start(table_check_batch, seed)
        table_check.run(backend, check, "xgraph", w.model, timer, iters)
        save()
    chosen = [b for b in batches if b in compile_batches]
    compiled = _Compiled(
        backend, w, chosen, compiler, compile_scope, compile_buckets, anchor_kernels
    )
    _compiled_rows(compiled, data, steps, timer, iters, save, probes)
    probes.finish(data["rows"])
    return snapshot()


def _eager_rows(
    backend: Backend,
    w: Workload,
    steps: dict[int, Step],
    rows: dict[int, dict[str, Any]],
    timer: Timer,
    iters: int,
    save: Callable[[], None],
    probes: Probes,
) -> None:
    """Each batch eagerly and through an executor over the eager forward."""
    batches = list(rows)
    ex = w.executor(w.model.forward, backend=backend, buckets=batches, on_capture_error="raise")
    eager = w.executor(w.model.forward, backend=backend, buckets=batches, mode="eager")
    for b in batches:
        _measure(backend, w, steps[b], (ex, eager), timer, iters, rows[b])
        _progress(rows[b])
        save()
    # traced only once every batch's host time is taken: a trace can leave the host slower
    # at issuing work for the rest of the process
    for b in batches:
        if "xgraph_s" in rows[b]:
            probes.observe(rows[b], "xgraph", steps[b], lambda s=steps[b]: ex(**s.kwargs()))
    ex.close()
    eager.close()
