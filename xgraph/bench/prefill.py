"""`xgraph bench prefill`: chunked-prefill step time, eager vs piecewise, and piecewise memory.

Step times: for each size, several batch compositions (one long chunk, equal chunks, many
short chunks, a random mix over cached context), the same steps run through an eager
executor and through a piecewise one (captured once per size, then replayed for every
composition). Memory: piecewise graphs for SGLang-style sizes up to the largest, captured
into shared-physical and shared-pool memory (largest first and ascending).
"""

from __future__ import annotations

import random
from typing import Any

from ..buckets import sglang_piecewise_sizes
from ..interfaces import Backend
from ..memory import GraphMemory
from ..models import Workload
from .readings import MiB, driver_reading, settle
from .report import header, table, workload
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


def _step_rows(
    backend: Backend, w: Workload, sizes: list[int], timer: Timer, iters: int, rng: random.Random
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Eager and piecewise time of every composition of every size, and the piecewise counts."""
    eager = w.executor(w.model.forward, backend=backend, buckets=sizes, mode="eager")
    pw = w.executor(w.model.forward, backend=backend, buckets=sizes, mode="piecewise")
    rows = []
    for n in sizes:
        for name, (ql, ctx) in compositions(n, rng).items():
            step = w.prefill_step(rng, ql, ctx).with_tensor_tables(
                w.max_blocks, w.cache.dummy_block
            )
            t_eager = timer(lambda step=step: eager(**step.kwargs()), iters)
            t_pw = timer(lambda step=step: pw(**step.kwargs()), iters)
            rows.append(
                {
                    "num_tokens": n,
                    "batch": name,
                    "seqs": len(ql),
                    "eager_s": t_eager,
                    "piecewise_s": t_pw,
                    "eager/piecewise": t_eager / t_pw,
                }
            )
    stats = pw.stats()
    eager.close()
    pw.close()
    return rows, {"captures": stats["captures"], "replays": stats["replays"]}


def _memory_row(backend: Backend, w: Workload, sizes: list[int], mode: str, order: str) -> dict:
    """Piecewise graphs of every size captured in `order` into fresh `mode` memory."""
    gm = GraphMemory(backend, mode)
    ex = w.executor(w.model.forward, backend=backend, buckets=sizes, memory=gm, mode="piecewise")
    base = settle(backend)
    ex.capture(sorted(sizes, reverse=order == "largest-first"), kind="piecewise", progress=False)
    now = settle(backend)
    stats = ex.stats()
    row = {
        "mode": mode,
        "order": order,
        "graph_bytes": (now or 0) - (base or 0) if driver_reading(backend) else gm.graph_bytes(),
        "pool_bytes": gm.graph_bytes(),
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
) -> dict[str, Any]:
    accel = backend.device.type != "cpu"
    sizes = sizes or ([128, 512, 2048] if accel else [32, 64, 128])
    memory_max = memory_max or (2048 if accel else 256)
    w = workload(backend, model, max_seqs=16, context=2 * max(max(sizes), memory_max))
    timer = Timer(backend)
    rows, counts = _step_rows(backend, w, sizes, timer, iters, random.Random(seed))
    mem_sizes = sglang_piecewise_sizes(memory_max)
    return {
        **header(backend, model, w),
        "timing": timer.unit,
        "steps": rows,
        "piecewise_stats": counts,
        "memory_sizes": mem_sizes,
        "memory": [_memory_row(backend, w, mem_sizes, m, o) for m, o in MEMORY_RUNS],
    }


def summarize(data: dict[str, Any]) -> str:
    head = (
        f"{data['backend']} / {data['device']} / {data['model']} ({data['dtype']}); "
        f"times: median {data['timing']}"
    )
    t1 = table(
        [
            {**r, "eager ms": r["eager_s"] * 1e3, "piecewise ms": r["piecewise_s"] * 1e3}
            for r in data["steps"]
        ],
        ["num_tokens", "batch", "seqs", "eager ms", "piecewise ms", "eager/piecewise"],
    )
    t2 = table(
        [{**r, "graph MiB": r["graph_bytes"] / MiB} for r in data["memory"]],
        ["mode", "order", "graphs", "graph MiB", "capture_seconds"],
    )
    return (
        f"{head}\n\n{t1}\n\npiecewise graph memory, {len(data['memory_sizes'])} sizes "
        f"up to {data['memory_sizes'][-1]}:\n\n{t2}"
    )
