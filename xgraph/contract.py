"""The adapter contract, checked once: when a backend class is chosen (and for `xgraph info`).

A backend class is complete when it has a name, its graph class is a CheckedGraph naming
its pool class, its virtual-memory class (if any) is a CheckedVirtualMemory, a torch-style
backend (`xgraph.adapter.TorchBackend`) names its runtime class, and none of these classes
(backend, graph, pool, virtual memory, runtime) leaves an abstract method of the contract
unimplemented, nor writes one half of an optional pair (a graph's `_keep_launches` and
`_launches`, a runtime's `readable_graph` and `graph_launches`: the parameterization check
needs both). The error names every missing duty at once. The registry also checks that
the class's name is the one its BackendSpec registers (`check_spec_name`).
"""

from __future__ import annotations

import inspect
from typing import Any

from .errors import IncompleteBackendError
from .graphs import CheckedGraph
from .hooks import BackendSpec
from .interfaces import Backend, CapturePool, Graph
from .vmm import CheckedVirtualMemory


def _graph_parts(cls: type[Backend], missing: list[str]) -> list[type]:
    graph_cls: Any = getattr(cls, "graph_class", None)
    if graph_cls is None:
        missing.append(f"{cls.__name__}.graph_class")
        return []
    if not (isinstance(graph_cls, type) and issubclass(graph_cls, CheckedGraph)):
        missing.append(f"{cls.__name__}.graph_class (a subclass of xgraph.adapter.CheckedGraph)")
        return []
    pool_cls = graph_cls.pool_type
    if pool_cls is CapturePool or not issubclass(pool_cls, CapturePool):
        missing.append(f"{graph_cls.__name__}.pool_type (the backend's CapturePool class)")
        return [graph_cls]
    return [graph_cls, pool_cls]


def _parts(cls: type[Backend], missing: list[str]) -> list[type]:
    """The classes that make up the backend, noting missing or misplaced ones in `missing`."""
    parts: list[type] = [cls, *_graph_parts(cls, missing)]
    if not getattr(cls, "name", None):
        missing.append(f"{cls.__name__}.name")
    vm_cls: Any = cls.virtual_memory_class
    if vm_cls is not None:
        if not (isinstance(vm_cls, type) and issubclass(vm_cls, CheckedVirtualMemory)):
            missing.append(
                f"{cls.__name__}.virtual_memory_class (a subclass of "
                "xgraph.adapter.CheckedVirtualMemory)"
            )
        else:
            parts.append(vm_cls)
    if hasattr(cls, "runtime_class"):  # a torch-style backend: its runtime is a duty too
        runtime_cls: Any = cls.runtime_class  # type: ignore[attr-defined]
        if not isinstance(runtime_cls, type):
            missing.append(f"{cls.__name__}.runtime_class (its xgraph.adapter.TorchRuntime)")
        else:
            parts.append(runtime_cls)
    return parts


# optional duties that only work together: where a class writes one, it writes the other
PAIRED_DUTIES = (("_keep_launches", "_launches"), ("readable_graph", "graph_launches"))


def _half_pairs(klass: type) -> list[str]:
    """The missing half of each optional pair of which `klass` writes only one half."""
    from .device.runtime import TorchRuntime  # the port that declares the runtime's pair

    # the pairs' defaults ("not supported"), as the contract declares them
    defaults = {n: f for c in (Graph, TorchRuntime) for n, f in vars(c).items()}
    out = []
    for pair in PAIRED_DUTIES:
        if not all(hasattr(klass, name) for name in pair):
            continue
        written = [inspect.getattr_static(klass, name) is not defaults[name] for name in pair]
        if written[0] != written[1]:
            lacking, has = (pair[1], pair[0]) if written[0] else pair
            out.append(f"{klass.__name__}.{lacking} (it writes {has})")
    return out


def check_backend_class(cls: type[Backend]) -> None:
    """Raise IncompleteBackendError naming every duty the adapter's classes leave undone."""
    missing: list[str] = []
    for klass in _parts(cls, missing):
        if inspect.isabstract(klass):
            missing += [f"{klass.__name__}.{m}" for m in sorted(klass.__abstractmethods__)]
        missing += _half_pairs(klass)
    for flag in ("graph_executables", "capture_refuses_host_reads"):  # what the core reads
        if not isinstance(getattr(cls, flag, None), bool):
            missing.append(f"{cls.__name__}.{flag} (a bool)")
    if missing:
        raise IncompleteBackendError(
            f"Backend class {cls.__module__}.{cls.__qualname__} is incomplete: it does not "
            f"implement {', '.join(missing)}. Implement them (see docs/writing-an-adapter.md) "
            "and run `xgraph conformance --backend NAME` to check the adapter."
        )


def check_spec_name(cls: type[Backend], spec: BackendSpec) -> None:
    """Raise IncompleteBackendError unless the class's name is the one its spec registers."""
    name = getattr(cls, "name", None)
    if name != spec.name:
        raise IncompleteBackendError(
            f"Backend {spec.name!r}: its class {cls.__module__}.{cls.__qualname__} is named "
            f"{name!r}. A backend's name is written twice (the BackendSpec selects it, the "
            "class reports it): make them equal."
        )
