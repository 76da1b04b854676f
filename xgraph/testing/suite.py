"""The conformance suite: abstract test classes every backend runs against itself.

An adapter subclasses `ConformanceSuite` (or single classes) and names its backend::

    from xgraph.testing import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        backend_name = "mybackend"

or runs `xgraph conformance --backend mybackend`. Without `backend_name` the backend comes
from `--xgraph-backend`, then XGRAPH_BACKEND, then the best available one. A backend that
is not available here makes the tests skip with its reason.
"""

from __future__ import annotations

from .conditions import EngineConditionTests
from .device_metadata import DeviceMetadataTests
from .discovery import PluginTests
from .executor import ExecutorTests
from .graph import GraphTests
from .kernels import KernelTests
from .multistep import MultiStepTests
from .parameterization import ParameterizationTests
from .piecewise import PiecewiseTests
from .pool import PoolTests
from .reliability import ReliabilityTests
from .sleep import SleepTests
from .threads import ThreadTests
from .vmm import VirtualMemoryTests


class ConformanceSuite(
    PluginTests,
    GraphTests,
    VirtualMemoryTests,
    ExecutorTests,
    PoolTests,
    PiecewiseTests,
    KernelTests,
    ReliabilityTests,
    SleepTests,
    ParameterizationTests,
    MultiStepTests,
    EngineConditionTests,
    DeviceMetadataTests,
    ThreadTests,
):
    """Every conformance test; subclass it once per backend."""
