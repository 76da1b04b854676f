"""Shared pieces of the benchmarks: workloads, GPU timing, memory readings, tables."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..interfaces import Backend
from ..models import Qwen3Model, Workload

MiB = 1 << 20


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


def settle(backend: Backend) -> int | None:
    """Synchronize, return cached default-allocator memory, read the driver's memory in use."""
    backend.synchronize()
    backend.empty_cache()
    return backend.memory_in_use()


class Timer:
    """Median time of a callable: device events on CUDA, perf_counter elsewhere."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.cuda = backend.device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        self.backend.synchronize()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    @property
    def unit(self) -> str:
        return "GPU time (CUDA events)" if self.cuda else "host wall time (CPU backend)"


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


def header(backend: Backend, model: str, w: Workload) -> dict[str, Any]:
    """What every benchmark's JSON starts with: backend, device, model and dtype."""
    return {
        "backend": backend.name,
        "device": device_name(backend),
        "model": model,
        "dtype": str(next(w.model.parameters()).dtype),
    }


def device_name(backend: Backend) -> str:
    if backend.device.type == "cuda":
        return torch.cuda.get_device_name(backend.device)
    import platform

    return f"{platform.processor() or platform.machine()} (CPU)"
