"""`xgraph bench prefill`: chunked-prefill step time, eager vs piecewise, and piecewise memory.

Step times: for each size, several batch compositions (one long chunk, equal chunks, many
short chunks, a random mix over cached context), the same steps run through an eager
executor and through a piecewise one (captured once per size, then replayed for every
composition); with `--compile`, also through a piecewise executor over the forward with its
layers torch.compile'd (`compile_layers`, `compiled=True`: Inductor's kernels in the
pieces), after the other columns so a slow compile costs nothing else. Memory: piecewise
graphs for SGLang-style sizes up to the largest, captured into shared-physical and
shared-pool memory (largest first and ascending).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ..buckets import sglang_piecewise_sizes
from ..executor import GraphExecutor
from ..interfaces import Backend
from ..memory import GraphMemory
from ..models import Step, Workload
from .anchors import compiled_twin, first_step
from .readings import MiB, driver_reading, settle
from .report import attempt, header, table, workload
from .timing import Timer

MEMORY_RUNS = (
    ("shared-physical", "ascending"),
    ("shared-physical", "largest-first"),
    ("shared-pool", "largest-first"),
    ("shared-pool", "ascending"),
)


def compositions(n: int, rng: random.Random) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query lens, cached context before the chunk)."""
    mix_cut = sorted(rng.sample(range(1, n), min(5, n - 1)))
    mix = [b - a for a, b in zip([0, *mix_cut], [*mix_cut, n])]
    return {
        f"1x{n}": ([n], [0]),
        f"4x{n // 4}": ([n // 4] * 4, [0] * 4),
        f"16x{n // 16}": ([n // 16] * 16, [n // 16] * 16),
        "mix+ctx": (mix, [rng.randint(0, n) for _ in mix]),
    }


def _steps(w: Workload, sizes: list[int], rng: random.Random) -> list[tuple[dict, Step]]:
    """Every composition of every size: its row (what it is) and its step."""
    out = []
    for n in sizes:
        for name, (ql, ctx) in compositions(n, rng).items():
            step = w.prefill_step(rng, ql, ctx).with_tensor_tables(
                w.max_blocks, w.cache.dummy_block
            )
            out.append(({"num_tokens": n, "batch": name, "seqs": len(ql)}, step))
    return out


def _time_all(
    ex: GraphExecutor, key: str, steps: list[tuple[dict, Step]], timer: Timer, iters: int
) -> None:
    """`ex`'s time of every step into its row as `key`, each step isolated from the rest."""
    for row, step in steps:
        attempt(row, key[:-2], lambda step=step: {key: timer(lambda: ex(**step.kwargs()), iters)})


def _compiled_column(
    backend: Backend,
    w: Workload,
    sizes: list[int],
    steps: list,
    timer: Timer,
    iters: int,
    compiler: str,
) -> dict[str, Any]:
    """The piecewise executor over the compiled twin: each size's first step (compile at the
    first sizes, capture) timed on its own, then every composition like the other columns."""
    twin = Workload(compiled_twin(w.model, compiler), w.max_blocks, w.max_seqs)
    ex = twin.executor(
        twin.model.forward,
        backend=backend,
        buckets=sizes,
        mode="piecewise",
        compiled=True,
        on_capture_error="raise",
    )
    sizes_done: set[int] = set()
    try:
        for row, step in steps:  # each size's first step on its own, isolated like the rest
            if row["num_tokens"] not in sizes_done:
                sizes_done.add(row["num_tokens"])
                attempt(
                    row,
                    "piecewise_compiled_first",
                    lambda s=step: {
                        "piecewise_compiled_first_step_s": first_step(
                            backend, lambda: ex(**s.kwargs())
                        )
                    },
                )
        _time_all(ex, "piecewise_compiled_s", steps, timer, iters)
        stats = ex.stats()
    finally:
        ex.close()
    return {"captures": stats["captures"], "replays": stats["replays"]}


def _step_rows(
    backend: Backend,
    w: Workload,
    sizes: list[int],
    timer: Timer,
    iters: int,
    rng: random.Random,
    compiler: str | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Eager and piecewise time of every composition of every size (and the piecewise
    executor over the compiled forward when `compiler` is given), with the executors' counts."""
    steps = _steps(w, sizes, rng)
    eager = w.executor(w.model.forward, backend=backend, buckets=sizes, mode="eager")
    pw = w.executor(
        w.model.forward, backend=backend, buckets=sizes, mode="piecewise", on_capture_error="raise"
    )
    _time_all(eager, "eager_s", steps, timer, iters)
    _time_all(pw, "piecewise_s", steps, timer, iters)
    stats = pw.stats()
    eager.close()
    pw.close()
    counts: dict[str, Any] = {"captures": stats["captures"], "replays": stats["replays"]}
    if compiler:
        attempt(
            counts,
            "compiled",
            lambda: {
                "compiled": _compiled_column(backend, w, sizes, steps, timer, iters, compiler)
            },
        )
    rows = [row for row, _ in steps]
    for r in rows:
        for a, b in (
            ("eager", "piecewise"),
            ("eager", "piecewise_compiled"),
            ("piecewise", "piecewise_compiled"),
        ):
            if r.get(f"{a}_s") and r.get(f"{b}_s"):
                r[f"{a}/{b}"] = r[f"{a}_s"] / r[f"{b}_s"]
    return rows, counts


def _memory_row(backend: Backend, w: Workload, sizes: list[int], mode: str, order: str) -> dict:
    """Piecewise graphs of every size captured in `order` into fresh `mode` memory."""
    gm = GraphMemory(backend, mode)
    ex = w.executor(w.model.forward, backend=backend, buckets=sizes, memory=gm, mode="piecewise")
    base, held = settle(backend), ex.persistent_bytes()
    ex.capture(sorted(sizes, reverse=order == "largest-first"), kind="piecewise", progress=False)
    now = settle(backend)
    stats = ex.stats()
    outputs = ex.persistent_bytes() - held  # output buffers: persistent, not graph memory
    row = {
        "mode": mode,
        "order": order,
        "graph_bytes": (now or 0) - (base or 0) - outputs
        if driver_reading(backend)
        else gm.graph_bytes(),
        "pool_bytes": gm.graph_bytes(),
        "outside_pool_bytes": stats["outside_pool_bytes"],
        "capture_seconds": stats["capture_seconds"],
        "graphs": stats["captures"],
    }
    ex.close()
    gm.close()
    settle(backend)
    return row


def run(
    backend: Backend,
    model: str = "tiny",
    sizes: list[int] | None = None,
    memory_max: int | None = None,
    iters: int = 10,
    seed: int = 0,
    compiler: str | None = None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Step times (with the compiled column when `compiler` names one: "inductor", or a
    torch.compile backend), then piecewise memory; `checkpoint` gets the data after each."""
    accel = backend.device.type != "cpu"
    sizes = sizes or ([128, 512, 2048] if accel else [32, 64, 128])
    memory_max = memory_max or (2048 if accel else 256)
    w = workload(backend, model, max_seqs=16, context=2 * max(max(sizes), memory_max))
    timer = Timer(backend)
    rows, counts = _step_rows(backend, w, sizes, timer, iters, random.Random(seed), compiler)
    mem_sizes = sglang_piecewise_sizes(memory_max)
    data = {
        **header(backend, model, w),
        "timing": timer.unit,
        "steps": rows,
        "piecewise_stats": counts,
        "memory_sizes": mem_sizes,
        "memory": [],
    }
    for mode, order in MEMORY_RUNS:
        (checkpoint or (lambda _: None))(data)
        row = {"mode": mode, "order": order}
        if attempt(row, "memory", lambda m=mode, o=order: _memory_row(backend, w, mem_sizes, m, o)):
            data["memory"].append(row)
        else:
            data.setdefault("memory_errors", []).append(row)
    return data


def _ms(row: dict[str, Any], key: str) -> Any:
    if key in row:
        return row[key] * 1e3
    return "failed" if f"{key[:-2]}_error" in row else ""


def summarize(data: dict[str, Any]) -> str:
    head = (
        f"{data['backend']} / {data['device']} / {data['model']} ({data['dtype']}); "
        f"times: median {data['timing']}"
    )
    compiled = "compiled" in data["piecewise_stats"] or "compiled_error" in data["piecewise_stats"]
    cols = ["num_tokens", "batch", "seqs", "eager ms", "piecewise ms", "eager/piecewise"]
    if compiled:
        cols += [
            "piecewise over compile ms",
            "eager/piecewise_compiled",
            "piecewise/piecewise_compiled",
        ]
    t1 = table(
        [
            {
                **r,
                "eager ms": _ms(r, "eager_s"),
                "piecewise ms": _ms(r, "piecewise_s"),
                "piecewise over compile ms": _ms(r, "piecewise_compiled_s"),
            }
            for r in data["steps"]
        ],
        cols,
    )
    notes = []
    c = data["piecewise_stats"]
    if "compiled" in c:
        key = "piecewise_compiled_first_step_s"
        firsts = ", ".join(f"{r['num_tokens']}: {r[key]:.1f} s" for r in data["steps"] if key in r)
        notes.append(f"piecewise over compile, first step per size (compile + capture): {firsts}")
    elif "compiled_error" in c:
        notes.append(f"piecewise over compile failed: {c['compiled_error']}")
    t2 = table(
        [
            {
                **r,
                "graph MiB": r["graph_bytes"] / MiB,
                "pool MiB": r["pool_bytes"] / MiB,
                "outside pool MiB": (r.get("outside_pool_bytes") or 0) / MiB,
            }
            for r in data["memory"]
        ],
        ["mode", "order", "graphs", "graph MiB", "pool MiB", "outside pool MiB", "capture_seconds"],
    )
    notes += [
        f"memory {r['mode']} {r['order']} failed: {r['memory_error']}"
        for r in data.get("memory_errors", [])
    ]
    mem = (
        f"piecewise graph memory, {len(data['memory_sizes'])} sizes up to "
        f"{data['memory_sizes'][-1]}:\n\n{t2}"
    )
    return "\n\n".join([head, t1, *(["\n".join(notes)] if notes else []), mem])
