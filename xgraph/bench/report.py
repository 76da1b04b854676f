"""What the benchmarks build on and write out: the workload, the JSON header, tables, files,
and the isolation of one measurement from the others (`attempt`, `Checkpoint`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..interfaces import Backend
from ..models import Qwen3Model, Workload
from . import hooks


def workload(
    backend: Backend,
    model: str,
    *,
    max_seqs: int,
    context: int,
    block_size: int = 16,
    seed: int = 0,
    num_blocks: int | None = None,
) -> Workload:
    """The reference model sized for `max_seqs` sequences of up to `context` tokens.

    bf16 on accelerators, float32 on the CPU; random weights (the numbers do not depend on
    the values). `num_blocks` (default: max_seqs full contexts) sizes the cache on its own,
    for views of the model with other layouts (`Workload(w.model, ...)`).
    """
    dev = backend.device
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    max_blocks = -(-context // block_size)
    m = Qwen3Model.build(
        model,
        num_blocks=max(num_blocks or 0, max_seqs * max_blocks),
        block_size=block_size,
        dtype=dtype,
        device=dev,
        seed=seed,
    )
    return Workload(m, max_blocks=max_blocks, max_seqs=max_seqs)


def header(backend: Backend, model: str, w: Workload) -> dict[str, Any]:
    """What every benchmark's JSON starts with: backend, device, model and dtype."""
    return {
        "backend": backend.name,
        "device": hooks.device_name(backend),
        "model": model,
        "dtype": str(next(w.model.parameters()).dtype),
    }


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """A Markdown table of the given columns."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)


def error_text(exc: BaseException) -> str:
    """An exception in one line, short enough for a table cell and a JSON field."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def attempt(row: dict[str, Any], name: str, fn: Callable[[], dict[str, Any] | None]) -> bool:
    """Run one measurement into `row` (fn returns fields to add, or None when it fills `row`
    itself); a failure is recorded as `{name}_error` and reported, never raised, so it cannot
    hide the measurements after it. True if it succeeded."""
    try:
        row.update(fn() or {})
        return True
    except Exception as exc:
        row[f"{name}_error"] = error_text(exc)
        note(f"{name} failed: {row[f'{name}_error']}")
        return False


def note(text: str) -> None:
    """A progress line on stderr (the tables come at the end; a run cut short keeps these)."""
    print(f"[bench] {text}", file=sys.stderr, flush=True)


class Checkpoint:
    """Writes a benchmark's JSON as it goes (marked partial), so a run stopped by a time
    limit still leaves what it measured; the final write replaces it."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __call__(self, data: dict[str, Any]) -> None:
        if self.path:
            write_json(self.path, {**data, "partial": True})
