"""What the benchmarks build on and write out: the workload, the JSON header, tables, files."""

from __future__ import annotations

import json
from typing import Any

import torch

from ..interfaces import Backend
from ..models import Qwen3Model, Workload


def workload(
    backend: Backend,
    model: str,
    *,
    max_seqs: int,
    context: int,
    block_size: int = 16,
    seed: int = 0,
) -> Workload:
    """The reference model sized for `max_seqs` sequences of up to `context` tokens.

    bf16 on accelerators, float32 on the CPU; random weights (the numbers do not depend on
    the values).
    """
    dev = backend.device
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    max_blocks = -(-context // block_size)
    m = Qwen3Model.build(
        model,
        num_blocks=max_seqs * max_blocks,
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
        "device": backend.device_name(),
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
