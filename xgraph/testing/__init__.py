"""Conformance suite for xgraph backends: subclass the classes, name the backend, run pytest.

from xgraph.testing import ConformanceSuite

class TestMyBackend(ConformanceSuite):
    backend_name = "mybackend"

Frames of this package are model code: the suite's own forwards are reported at their lines.
"""

import os

from ..safety import register_model_path
from .base import BackendTests, capture, small_mlp
from .discovery import PluginTests
from .executor import ExecutorTests
from .graph import GraphTests
from .kernels import KernelTests
from .piecewise import PiecewiseTests
from .pool import PoolTests
from .sleep import SleepTests
from .suite import ConformanceSuite
from .vmm import VirtualMemoryTests

register_model_path(os.path.dirname(os.path.abspath(__file__)))

__all__ = [
    "BackendTests",
    "ConformanceSuite",
    "ExecutorTests",
    "GraphTests",
    "KernelTests",
    "PiecewiseTests",
    "PluginTests",
    "PoolTests",
    "SleepTests",
    "VirtualMemoryTests",
    "capture",
    "small_mlp",
]
