"""The adapter contract, checked once: when a backend class is chosen (and for `xgraph info`).

A backend class is complete when its graph class is a CheckedGraph naming its pool class,
its virtual-memory class (if any) is a CheckedVirtualMemory, and none of the four classes
(backend, graph, pool, virtual memory) leaves an abstract method of xgraph.interfaces
unimplemented. The error names every missing duty at once.
"""

from __future__ import annotations

import inspect
from typing import Any

from .errors import IncompleteBackendError
from .graphs import CheckedGraph
from .interfaces import Backend, CapturePool
from .vmm import CheckedVirtualMemory


def _parts(cls: type[Backend], missing: list[str]) -> list[type]:
    """The classes that make up the backend, noting missing or misplaced ones in `missing`."""
    parts: list[type] = [cls]
    if not getattr(cls, "name", None):
        missing.append(f"{cls.__name__}.name")
    graph_cls: Any = getattr(cls, "graph_class", None)
    if graph_cls is None:
        missing.append(f"{cls.__name__}.graph_class")
    elif not (isinstance(graph_cls, type) and issubclass(graph_cls, CheckedGraph)):
        missing.append(f"{cls.__name__}.graph_class (a subclass of xgraph.CheckedGraph)")
    else:
        parts.append(graph_cls)
        pool_cls = graph_cls.pool_type
        if pool_cls is CapturePool or not issubclass(pool_cls, CapturePool):
            missing.append(f"{graph_cls.__name__}.pool_type (the backend's CapturePool class)")
        else:
            parts.append(pool_cls)
    vm_cls: Any = cls.virtual_memory_class
    if vm_cls is not None:
        if not (isinstance(vm_cls, type) and issubclass(vm_cls, CheckedVirtualMemory)):
            missing.append(
                f"{cls.__name__}.virtual_memory_class (a subclass of xgraph.CheckedVirtualMemory)"
            )
        else:
            parts.append(vm_cls)
    return parts


def check_backend_class(cls: type[Backend]) -> None:
    """Raise IncompleteBackendError naming every duty the adapter's classes leave undone."""
    missing: list[str] = []
    for klass in _parts(cls, missing):
        if inspect.isabstract(klass):
            missing += [f"{klass.__name__}.{m}" for m in sorted(klass.__abstractmethods__)]
    if missing:
        raise IncompleteBackendError(
            f"Backend class {cls.__module__}.{cls.__qualname__} is incomplete: it does not "
            f"implement {', '.join(missing)}. Implement them (see docs/writing-an-adapter.md) "
            "and run `xgraph conformance --backend NAME` to check the adapter."
        )
