"""The context-width check of `xgraph bench decode --table-check BATCH`.

An engine sizes its block tables for the longest sequence it serves, while most steps
attend over much less. Here every sequence of the batch has exactly 512 tokens of context,
and the same step runs through two executors over the same model and KV cache: block
tables 512 tokens wide (no spare columns) and 4096 tokens wide. A decode kernel that reads
only each sequence's real context takes the same time for both; one that walks the whole
table width does not. Reported: xgraph's step time for each width and the ratio
wide / narrow (target: at most `TARGET`), for the executor over the eager forward and,
when the run built one, over the compiled forward.
"""

from __future__ import annotations

import random
from typing import Any

from ..interfaces import Backend
from ..models import Qwen3Model, Workload
from .report import attempt, note
from .timing import Timer

CONTEXT = 512
WIDTHS = {"narrow": 512, "wide": 4096}  # block-table width in tokens
TARGET = 1.2


def blocks_needed(batch: int, block_size: int) -> int:
    """Cache blocks the check's step lays out (each sequence its own blocks)."""
    return batch * -(-CONTEXT // block_size)


def _time(
    backend: Backend, view: Workload, step: Any, timer: Timer, iters: int, compiled: bool
) -> float:
    """xgraph's step time over one layout (an executor of its own, closed after)."""
    batch = step.num_tokens
    ex = view.executor(
        view.model.forward,
        backend=backend,
        buckets=[batch],
        compiled=compiled,
        on_capture_error="raise",
    )
    try:
        wide = step.with_tensor_tables(view.max_blocks, view.cache.dummy_block)
        return timer(lambda: ex(**wide.kwargs()), iters)
    finally:
        ex.close()


def start(batch: int, seed: int = 0) -> dict[str, Any]:
    """The check's record, before any variant ran (the seed draws its one step)."""
    return {
        "batch": batch,
        "context": CONTEXT,
        "width_tokens": dict(WIDTHS),
        "target": TARGET,
        "seed": seed,
    }


def run(
    backend: Backend,
    out: dict[str, Any],
    variant: str,
    model: Qwen3Model,
    timer: Timer,
    iters: int,
) -> None:
    """Both widths for one variant ("xgraph": the eager forward; "xgraph_compiled": a model
    whose layers are compiled), into `out`; the same step (same seed) for every variant."""
    batch, bs = out["batch"], model.kv_cache.block_size
    narrow = Workload(model, -(-WIDTHS["narrow"] // bs), batch)
    step = narrow.step(random.Random(out["seed"]), [1] * batch, [CONTEXT] * batch)
    for name, tokens in WIDTHS.items():
        view = Workload(model, -(-tokens // bs), batch)
        key = f"{variant}_{name}"
        attempt(
            out,
            key,
            lambda view=view, key=key: {
                f"{key}_s": _time(backend, view, step, timer, iters, variant != "xgraph")
            },
        )
    if f"{variant}_narrow_s" in out and f"{variant}_wide_s" in out:
        ratio = out[f"{variant}_wide_s"] / out[f"{variant}_narrow_s"]
        out[f"{variant}_wide/narrow"] = ratio
        note(f"table check {variant}: wide/narrow {ratio:.3f} (target <= {TARGET})")


def summarize(check: dict[str, Any]) -> str:
    """One line per variant: both step times and the ratio against the target."""
    lines = []
    for variant, label in (("xgraph", "xgraph"), ("xgraph_compiled", "xgraph over compile")):
        times = []
        for name, tokens in WIDTHS.items():
            t = check.get(f"{variant}_{name}_s")
            err = check.get(f"{variant}_{name}_error")
            times.append(
                f"{tokens}-token tables {t * 1e3:.3f} ms"
                if t is not None
                else f"{tokens}-token tables failed ({err})"
                if err
                else ""
            )
        if not any(times):
            continue
        ratio = check.get(f"{variant}_wide/narrow")
        verdict = (
            f"wide/narrow {ratio:.3f} ({'within' if ratio <= TARGET else 'above'} "
            f"the {TARGET}x target)"
            if ratio is not None
            else "no ratio"
        )
        lines.append(f"- {label}: " + ", ".join(t for t in times if t) + f"; {verdict}")
    head = (
        f"context-width check: batch {check['batch']}, every sequence {check['context']} "
        "tokens of context"
    )
    return "\n".join([head, *lines])
