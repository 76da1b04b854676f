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
from .common import MiB, Timer, header, settle, table, workload


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


def run(
    backend: Backend,
    model: str = "tiny",
    sizes: list[int] | None = None,
    memory_max: int | None = None,
    iters: int = 10,
    seed: int = 0,
) -> dict[str, Any]:
    cpu = backend.device.type == "cpu"
    sizes = sizes or ([32, 64, 128] if cpu else [128, 512, 2048])
    memory_max = memory_max or (256 if cpu else 2048)
    largest = max(max(sizes), memory_max)
    w = workload(backend, model, max_seqs=16, context=2 * largest)
    timer = Timer(backend)
    rng = random.Random(seed)
    eager = w.executor(w.model.forward, backend=backend, buckets=sizes, mode="eager")
    pw = w.executor(w.model.forward, backend=backend, buckets=sizes, mode="piecewise")
    rows = []
    for n in sizes:
        for name, (ql, ctx) in compositions(n, rng).items():
            step = w.prefill_step(rng, ql, ctx).with_tensor_tables(w.max_blocks,
                                                                   w.cache.dummy_block)
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
    mem_sizes = sglang_piecewise_sizes(memory_max)
    mem_rows = []
    for mode, order in (
        ("shared-physical", "ascending"),
        ("shared-physical", "largest-first"),
        ("shared-pool", "largest-first"),
        ("shared-pool", "ascending"),
    ):
        gm = GraphMemory(backend, mode)
        ex = w.executor(
            w.model.forward, backend=backend, buckets=mem_sizes, memory=gm, mode="piecewise"
        )
        base = settle(backend)
        todo = sorted(mem_sizes, reverse=order == "largest-first")
        ex.capture(todo, kind="piecewise", progress=False)
        now = settle(backend)
        mem_rows.append(
            {
                "mode": mode,
                "order": order,
                "graph_bytes": gm.graph_bytes() if cpu else (now or 0) - (base or 0),
                "pool_bytes": gm.graph_bytes(),
                "capture_seconds": ex.stats()["capture_seconds"],
                "graphs": ex.stats()["captures"],
            }
        )
        ex.close()
        gm.close()
        settle(backend)
    return {
        **header(backend, model, w),
        "timing": timer.unit,
        "steps": rows,
        "piecewise_stats": {"captures": stats["captures"], "replays": stats["replays"]},
        "memory_sizes": mem_sizes,
        "memory": mem_rows,
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
