"""Conformance suite for xgraph backends: subclass the classes, name the backend, run pytest.

from xgraph.testing import ConformanceSuite

class TestMyBackend(ConformanceSuite):
    backend_name = "mybackend"

The suite's modules are model code for capture errors: its own forwards are reported at
their lines. `xgraph.testing.sim` (a simulated torch runtime) and `xgraph.testing.faults`
need no pytest; the suite classes are imported on first use.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from ..safety import register_model_path

_SUITE = {
    "BackendTests": "base",
    "Capabilities": "capabilities",
    "capture": "base",
    "small_mlp": "base",
    "PluginTests": "discovery",
    "RunnerCase": "device_metadata",
    "ExecutorTests": "executor",
    "GraphTests": "graph",
    "KernelTests": "kernels",
    "MultiStepTests": "multistep",
    "ParameterizationTests": "parameterization",
    "PiecewiseTests": "piecewise",
    "PoolTests": "pool",
    "ReliabilityTests": "reliability",
    "SleepTests": "sleep",
    "ThreadTests": "threads",
    "ConformanceSuite": "suite",
    "DeviceMetadataTests": "device_metadata",
    "EngineConditionTests": "conditions",
    "VirtualMemoryTests": "vmm",
}

_here = os.path.dirname(os.path.abspath(__file__))
for _module in sorted(set(_SUITE.values())):
    register_model_path(os.path.join(_here, f"{_module}.py"))


def __getattr__(name: str) -> Any:
    if name not in _SUITE:
        raise AttributeError(f"module 'xgraph.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_SUITE[name]}", __name__), name)
    globals()[name] = value  # resolved once: later lookups (and pdoc) find it as a member
    return value


__all__ = sorted(_SUITE)
