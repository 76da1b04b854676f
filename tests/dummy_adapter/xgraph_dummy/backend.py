from __future__ import annotations

import os

from xgraph.backends.cpu import CPUBackend, CPUGraph, HostVirtualMemory
from xgraph.interfaces import Availability


def probe() -> Availability:
    if os.environ.get("XGRAPH_DUMMY_BACKEND") == "1":
        return Availability(True, "test adapter (host memory)")
    return Availability(False, "test adapter: set XGRAPH_DUMMY_BACKEND=1 to enable it")


class DummyGraph(CPUGraph):
    pass


class DummyVirtualMemory(HostVirtualMemory):
    def __init__(self, backend: object = None) -> None:
        super().__init__(backend, granularity=128 * 1024)


class DummyBackend(CPUBackend):
    name = "dummy"
    priority = 10
    graph_class = DummyGraph
    virtual_memory_class = DummyVirtualMemory

    @classmethod
    def availability(cls) -> Availability:
        return probe()
