"""`xgraph bench memory`: graph memory and capture time per memory mode and capture order.

For each mode (private, shared-pool, shared-physical) and order (largest-first, ascending,
random) one fresh executor captures full decode graphs of the reference model for every
size, in one process. Graph memory is read as `readings` says (the driver's reading minus a
baseline taken after the model, KV cache and persistent buffers exist, on accelerators that
report one; the pool's bytes elsewhere, with the process's memory in use beside it). The
limit is the largest size captured alone into a fresh pool, measured the same way in the
same run.
"""

from __future__ import annotations

import random
from typing import Any

from ..buckets import vllm_capture_sizes
from ..interfaces import Backend
from ..memory import GraphMemory
from ..models import Workload
from .readings import MiB, driver_reading, measure, settle
from .report import header, table, workload

MODES = ("private", "shared-pool", "shared-physical")
ORDERS = ("largest-first", "ascending", "random")


def ordered(sizes: list[int], order: str, seed: int) -> list[int]:
    if order == "largest-first":
        return sorted(sizes, reverse=True)
    if order == "ascending":
        return sorted(sizes)
    if order == "random":
        return random.Random(seed).sample(sizes, len(sizes))
    raise ValueError(f"unknown order {order!r}")


def _measure_capture(
    backend: Backend, w: Workload, mode: str, sizes: list[int], order_sizes: list[int]
) -> dict[str, Any]:
    mem = GraphMemory(backend, mode)
    ex = w.executor(
        w.model.forward, backend=backend, buckets=sizes, memory=mem, name=f"bench-{mode}"
    )
    driver = driver_reading(backend)
    base = settle(backend)
    curve, resident = [], []
    for n in order_sizes:
        ex.capture([n], progress=False)
        now = settle(backend)
        resident.append((now or 0) - (base or 0))
        curve.append(resident[-1] if driver else mem.graph_bytes())
    s = ex.stats()
    result = {
        "mode": mode,
        "graph_bytes": curve[-1],
        "pool_bytes": mem.graph_bytes(),
        "resident_bytes": resident[-1],
        "capture_seconds": s["capture_seconds"],
        "captures": s["captures"],
        "curve_bytes": curve,
    }
    if mem.physical is not None:
        result["physical"] = mem.physical.stats()
    ex.close()
    mem.close()
    settle(backend)
    return result


def run(
    backend: Backend,
    model: str = "tiny",
    sizes: list[int] | None = None,
    modes: tuple[str, ...] = MODES,
    orders: tuple[str, ...] = ORDERS,
    seed: int = 0,
    context: int = 64,
) -> dict[str, Any]:
    sizes = sorted(sizes or vllm_capture_sizes(512 if backend.device.type != "cpu" else 128))
    w = workload(backend, model, max_seqs=max(sizes), context=context)
    # one eager step at the largest size first: library workspaces and lazy state are
    # created outside every measurement
    warm = w.executor(w.model.forward, backend=backend, buckets=sizes, mode="eager")
    with backend.warmup_context():  # on the capture stream, like the executor's warm-up
        warm(**w.decode_step(random.Random(0), max(sizes), max_context=16).kwargs())
    warm.close()
    settle(backend)
    _measure_capture(backend, w, "private", sizes, [max(sizes)])  # one-time costs, unmeasured
    limit = _measure_capture(backend, w, "private", sizes, [max(sizes)])
    runs = []
    for mode in modes:
        for order in orders:
            r = _measure_capture(backend, w, mode, sizes, ordered(sizes, order, seed))
            r["order"] = order
            runs.append(r)
    return {
        **header(backend, model, w),
        "buckets": sizes,
        "limit_bytes": limit["graph_bytes"],
        "limit_resident_bytes": limit["resident_bytes"],
        "measure": measure(backend),
        "runs": runs,
    }


def summarize(data: dict[str, Any]) -> str:
    limit = data["limit_bytes"]
    sp_best = next(
        (
            r["graph_bytes"]
            for r in data["runs"]
            if r["mode"] == "shared-pool" and r["order"] == "largest-first"
        ),
        None,
    )
    sp_secs = {r["order"]: r["capture_seconds"] for r in data["runs"] if r["mode"] == "shared-pool"}
    rows = []
    for r in data["runs"]:
        rows.append(
            {
                "mode": r["mode"],
                "order": r["order"],
                "graph MiB": r["graph_bytes"] / MiB,
                "x limit": r["graph_bytes"] / limit if limit else float("nan"),
                "x shared-pool best": r["graph_bytes"] / sp_best if sp_best else float("nan"),
                "capture s": r["capture_seconds"],
                "x shared-pool s": r["capture_seconds"] / sp_secs[r["order"]]
                if r["order"] in sp_secs
                else float("nan"),
            }
        )
    head = (
        f"{data['backend']} / {data['device']} / {data['model']} ({data['dtype']}), "
        f"{len(data['buckets'])} sizes {data['buckets'][0]}..{data['buckets'][-1]}; "
        f"limit (largest alone) {limit / MiB:.2f} MiB; measure: {data['measure']}"
    )
    return (
        head
        + "\n\n"
        + table(
            rows,
            [
                "mode",
                "order",
                "graph MiB",
                "x limit",
                "x shared-pool best",
                "capture s",
                "x shared-pool s",
            ],
        )
    )


def plot(data: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"private": ":", "shared-pool": "--", "shared-physical": "-"}
    for r in data["runs"]:
        ys = [b / MiB for b in r["curve_bytes"]]
        ax.plot(
            range(1, len(ys) + 1),
            ys,
            styles.get(r["mode"], "-"),
            label=f"{r['mode']}, {r['order']}",
        )
    ax.axhline(data["limit_bytes"] / MiB, color="k", lw=0.8, label="largest bucket alone")
    ax.set_xlabel("buckets captured")
    ax.set_ylabel("graph memory (MiB)")
    ax.set_yscale("log")
    ax.set_title(f"{data['model']} on {data['device']}: graph memory by mode and order")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
