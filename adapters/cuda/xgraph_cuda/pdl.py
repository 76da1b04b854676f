"""Programmatic dependent launch (PDL) for the adapter's Triton kernels, while a capture asks.

Inside `enabled_for(True)` (the backend enters it around the capture of a full decode graph
when the executor asks for PDL), the kernels are launched with the programmatic stream
serialization attribute and wait for their predecessor in the kernel (`gdc_wait`) before
they read or write anything, then let their successor launch (`gdc_launch_dependents`).
Stream capture turns each such launch after a kernel into a programmatic edge of the graph.
Anywhere else they launch as usual, with no wait compiled in. A kernel launched without the
attribute (cuBLAS, Inductor's) keeps a full dependency on its predecessor, and a kernel that
follows it waits for it to complete, so the two kinds mix safely.

`CUDAProgrammaticLaunch` is the backend's `Kernels.pdl`: PDL in full graphs on GPUs of
compute capability 9.0 and up (Hopper), and the count of a captured graph's programmatic
edges (`edges`), which `GraphExecutor(pdl=True)` asks of each full graph it captures.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from xgraph.adapter import ProgrammaticLaunch, StreamGraph, XGraphError

from .kernels import pdl_options

_local = threading.local()
logger = logging.getLogger("xgraph")


def enabled() -> bool:
    """Whether launches in this thread use PDL now."""
    return bool(getattr(_local, "on", False))


def waits() -> bool:
    """Whether launches in this thread compile the predecessor wait in without PDL."""
    return bool(getattr(_local, "waits", False))


@contextmanager
def enabled_for(on: bool, waits_only: bool = False) -> Iterator[None]:
    """Launch the adapter's kernels in this thread with PDL (`on`) until the block ends;
    `waits_only`: without the attribute, but the same binaries PDL launches (the race
    check's baseline: two graphs that differ by the launch attribute alone)."""
    before = enabled(), waits()
    _local.on, _local.waits = on, waits_only
    try:
        yield
    finally:
        _local.on, _local.waits = before


MAX_MIB = "64"  # see max_bytes


def max_bytes() -> int | None:
    """XGRAPH_CUDA_PDL_MAX_MIB (default 64): under PDL, a projection whose weights exceed
    this many MiB launches without the attribute (a full edge from its predecessor, the same
    binary); `none`: every launch takes it. Measured in whole Qwen3-8B decode steps on an
    H100 (docs/kernels.md): programmatic edges into its gate/up (192 MiB) and down (96 MiB)
    projections cost 2.1 / 1.4% at batch 1 / 8, those into qkv (48) and o (32) gain; at
    Qwen3-0.6B every projection is under 16 MiB and PDL takes 12% off batch 1."""
    raw = os.environ.get("XGRAPH_CUDA_PDL_MAX_MIB", MAX_MIB).strip().lower()
    if raw in ("", "none"):
        return None
    try:
        return int(float(raw) * (1 << 20))
    except ValueError as exc:
        raise XGraphError(
            f"XGRAPH_CUDA_PDL_MAX_MIB={raw!r} is not a number of MiB; give one (16) or none."
        ) from exc


def launch_options(is_cuda: bool, weight_bytes: int = 0, attribute: bool = True) -> dict:
    """The PDL constexpr and launch option of a kernel launched now (none off the GPU: the
    interpreter has no grid dependency control). `weight_bytes`: what the kernel streams;
    past `max_bytes`, or with `attribute` False, it keeps PDL's binary but not the
    attribute."""
    on = enabled() and is_cuda
    limit = max_bytes() if on else None
    if on and (not attribute or (limit is not None and weight_bytes > limit)):
        return pdl_options(False, True)
    return pdl_options(on, waits() and is_cuda)


def supported(device: torch.device) -> bool:
    """Whether the device runs programmatic dependent launch (compute capability >= 9.0)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


class CUDAProgrammaticLaunch(ProgrammaticLaunch):
    """PDL for the adapter's kernels in full graphs, where the device has it."""

    def __init__(self, device: torch.device, available: bool | None = None) -> None:
        self.available = supported(device) if available is None else available

    def capture(self, kind: str, enabled: bool) -> AbstractContextManager[Any]:
        return enabled_for(enabled and kind == "full" and self.available)

    def baseline(self, kind: str) -> AbstractContextManager[Any]:
        """The wait compiled in, no launch attribute: PDL's binaries in an ordinary graph."""
        return enabled_for(False, waits_only=kind == "full" and self.available)

    def programmatic_edges(self, graph: Any) -> int | None:
        """Programmatic edges of a torch CUDAGraph captured with keep_graph=True, of the
        backend's graph kept readable (`keep_launches`), or of a raw cudaGraph_t; None where
        its graph is not readable."""
        from .edges import count_programmatic

        raw = _raw(graph)
        return count_programmatic(raw) if raw else None

    def captured(self, graph: Any) -> int | None:
        """The edges of an executor's graph just captured with PDL (kept: keep_graph=True),
        then its executable made: torch would make it at the first replay, after the
        capture's memory reading, which would then miss the executable's device memory.
        Edges that cannot be counted (cuda-python missing or too old) are None, logged:
        the graph runs all the same."""
        try:
            edges = self.programmatic_edges(graph)
        except XGraphError as exc:
            logger.warning("PDL: a captured graph's programmatic edges not counted: %s", exc)
            edges = None
        kept = graph.runtime_graph if isinstance(graph, StreamGraph) else graph
        if _raw(graph) and hasattr(kept, "instantiate"):
            kept.instantiate()  # once: the first replay launches this executable
        return edges


def _raw(graph: Any) -> int | None:
    """The cudaGraph_t behind a graph (see `programmatic_edges`), or None."""
    if isinstance(graph, StreamGraph):
        graph = graph.runtime_graph
    if not hasattr(graph, "raw_cuda_graph"):
        return int(graph)  # a raw handle already
    try:
        return int(graph.raw_cuda_graph())
    except RuntimeError:  # not kept: torch destroyed it at capture_end
        return None
