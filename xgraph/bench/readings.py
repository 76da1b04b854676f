"""How the benchmarks read graph memory: the driver's reading, or the capture pool's own bytes.

On an accelerator whose backend reports memory in use (CUDA: total - free), graph memory is
that reading after returning cached default-allocator memory, minus a baseline taken before
the captures. Elsewhere it is the pool's bytes: on the CPU backend the memfd-backed physical
memory, with the process's proportional resident size (Pss) read beside it.
"""

from __future__ import annotations

from ..interfaces import Backend
from ..memory import settled_reading as settle

__all__ = ["MiB", "driver_reading", "measure", "settle"]

MiB = 1 << 20


def driver_reading(backend: Backend) -> bool:
    """Whether graph memory comes from the driver (an accelerator that reports memory in use)
    rather than from the pool (the CPU backend's Pss covers the whole process, not graphs)."""
    return backend.device.type != "cpu" and backend.memory_in_use() is not None


def measure(backend: Backend) -> str:
    """What `graph_bytes` means in this run, for the reports' "measure" field."""
    if driver_reading(backend):
        return "driver: memory in use after empty_cache, minus baseline"
    if backend.device.type == "cpu":
        return "pool bytes (memfd physical) and Pss"
    return "pool bytes (the backend reports no driver reading)"
