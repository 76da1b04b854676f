"""A complete third-party backend, written the torch-style way: a runtime, a VMM, a probe.

Its device is `xgraph.testing.sim.SimRuntime`, a simulated torch runtime on the host that
enforces the rules real runtimes break on. A real adapter writes the same parts over its
torch module: a `TorchRuntime` of one-liners (streams, graphs, MemPools, memory), the seven
driver calls of its virtual memory, and a probe. Everything else (capture streams, graphs,
capture pools, failed-capture undo, the threading rules) is `xgraph.adapter.TorchBackend`'s.
"""

from __future__ import annotations

import os
from typing import Any

from xgraph.adapter import Availability, CheckedVirtualMemory, TorchBackend
from xgraph.testing.sim import SimRuntime

GRANULARITY = 128 * 1024


def probe() -> Availability:
    if os.environ.get("XGRAPH_DUMMY_BACKEND") == "1":
        return Availability(True, "test adapter (a simulated torch runtime on the host)")
    return Availability(False, "test adapter: set XGRAPH_DUMMY_BACKEND=1 to enable it")


class DummyVirtualMemory(CheckedVirtualMemory):
    """The seven driver calls, each one call of the simulated driver's memory."""

    def __init__(self, backend: DummyBackend) -> None:
        self.driver = backend.runtime.memory  # reserve/create/map ... of the simulated device
        super().__init__(backend)

    def _granularity(self) -> int:
        return self.driver.granularity

    def _reserve_range(self, size: int) -> int:
        return self.driver.reserve(size)

    def _release_range(self, address: int, size: int) -> None:
        self.driver.release(address)

    def _create_chunk(self, size: int) -> Any:
        return self.driver.create(size)

    def _free_chunk(self, handle: Any, size: int) -> None:
        self.driver.free(handle)

    def _map_chunk(self, address: int, handle: Any, size: int) -> None:
        self.driver.map(address, handle)

    def _unmap_chunk(self, address: int, size: int) -> None:
        self.driver.unmap(address)


class DummyRuntime(SimRuntime):
    """The runtime: a real adapter's is one-liners over its torch module (torch.cuda ...)."""

    def __init__(self) -> None:
        super().__init__(granularity=GRANULARITY, refuse_host_reads=True)


class DummyBackend(TorchBackend):
    """The simulated device: the layer does the rest."""

    name = "dummy"
    runtime: SimRuntime
    runtime_class = DummyRuntime
    virtual_memory_class = DummyVirtualMemory
    capture_refuses_host_reads = True  # its runtime fails a capture that reads on the host

    @classmethod
    def availability(cls) -> Availability:
        return probe()
