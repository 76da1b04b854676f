"""Conformance suite for xgraph backends: subclass the classes, name the backend, run pytest.

from xgraph.testing import ConformanceSuite

class TestMyBackend(ConformanceSuite):
    backend_name = "mybackend"
"""

from .suite import (
    BackendTests,
    ConformanceSuite,
    ExecutorTests,
    GraphTests,
    PiecewiseTests,
    PluginTests,
    PoolTests,
    VirtualMemoryTests,
    capture,
)

__all__ = [
    "BackendTests",
    "ConformanceSuite",
    "ExecutorTests",
    "GraphTests",
    "PiecewiseTests",
    "PluginTests",
    "PoolTests",
    "VirtualMemoryTests",
    "capture",
]
