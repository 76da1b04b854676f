"""The benchmark hooks a backend may have (`xgraph.interfaces.BenchmarkHooks`), looked up.

Each is optional and asked for by name, so a backend without one gets the fallback: its
device as a string, host wall time, no native-graph anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..interfaces import Backend


def device_name(backend: Backend) -> str:
    hook = getattr(backend, "device_name", None)
    return str(hook()) if hook is not None else str(backend.device)


def time_on_device(backend: Backend, fn: Callable[[], Any]) -> float | None:
    hook = getattr(backend, "time_on_device", None)
    return hook(fn) if hook is not None else None


def native_graph(backend: Backend, fn: Callable[[], Any]) -> Callable[[], None] | None:
    hook = getattr(backend, "native_graph", None)
    return hook(fn) if hook is not None else None
