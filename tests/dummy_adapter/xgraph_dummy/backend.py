"""A complete third-party backend: every duty xgraph.interfaces declares, and nothing more.

It is a host "device" built from xgraph's host building blocks (memfd virtual memory, a
caching pool, an op tape), so each duty below is a line or two that says which runtime call
does the work. A real adapter puts its runtime's calls in the same places.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from xgraph import Availability, Backend, CapturePool, CheckedGraph, CheckedVirtualMemory
from xgraph.backends.cpu import HostCachingPool, HostVirtualMemory, OpTape, host_tensor
from xgraph.backends.cpu.vmm import proportional_resident_bytes
from xgraph.interfaces import SegmentAllocator

GRANULARITY = 128 * 1024


def probe() -> Availability:
    if os.environ.get("XGRAPH_DUMMY_BACKEND") == "1":
        return Availability(True, "test adapter (host memory)")
    return Availability(False, "test adapter: set XGRAPH_DUMMY_BACKEND=1 to enable it")


class DummyVirtualMemory(CheckedVirtualMemory):
    """The seven driver calls, each one call of the host "runtime" (memfd + mmap)."""

    def __init__(self, backend: Backend) -> None:
        self.runtime = HostVirtualMemory(granularity=GRANULARITY)
        super().__init__(backend)

    def _granularity(self) -> int:
        return self.runtime.granularity

    def _reserve_range(self, size: int) -> int:
        return self.runtime.reserve(size)

    def _release_range(self, address: int, size: int) -> None:
        self.runtime.release(address)

    def _create_chunk(self, size: int) -> Any:
        return self.runtime.create(size)

    def _free_chunk(self, handle: Any, size: int) -> None:
        self.runtime.free(handle)

    def _map_chunk(self, address: int, handle: Any, size: int) -> None:
        self.runtime.map(address, handle)

    def _unmap_chunk(self, address: int, size: int) -> None:
        self.runtime.unmap(address)


class DummyPool(CapturePool):
    """A native pool: a host caching allocator taking its segments from `segments` if given."""

    def __init__(self, vm: HostVirtualMemory, segments: SegmentAllocator | None) -> None:
        super().__init__(segments)
        self.cache = HostCachingPool(vm, segments)

    def reserved_bytes(self) -> int:
        return self.cache.reserved_bytes()

    def _release(self) -> None:
        self.cache.close()


class DummyGraph(CheckedGraph):
    """The four driver calls (and the optional op hook) over an op tape."""

    pool_type = DummyPool

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self.tape = OpTape()

    def _begin(self, pool: CapturePool) -> None:
        assert isinstance(pool, DummyPool)
        self.tape.begin(pool.cache)

    def _record_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        return self.tape.record(func, args, kwargs, out)

    def _end(self) -> None:
        self.tape.seal()

    def _replay(self) -> None:
        self.tape.replay()

    def _reset(self) -> None:
        self.tape.clear()


class DummyBackend(Backend):
    """The five backend duties."""

    name = "dummy"
    priority = 10
    graph_class = DummyGraph
    virtual_memory_class = DummyVirtualMemory

    def __init__(self) -> None:
        self._pool_memory = HostVirtualMemory(granularity=GRANULARITY)

    @classmethod
    def availability(cls) -> Availability:
        return probe()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_pool(self, segments: SegmentAllocator | None = None) -> CapturePool:
        return DummyPool(self._pool_memory, segments)

    def synchronize(self) -> None:
        """Host work completes before it returns: nothing is queued."""

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return host_tensor(address, nbytes)

    # an optional hook: the memory-teardown conformance tests read it
    def memory_in_use(self) -> int | None:
        return proportional_resident_bytes() or None
