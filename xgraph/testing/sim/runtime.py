"""SimRuntime: a TorchRuntime on the host that enforces the rules real runtimes break on.

The device is the host (torch.device("cpu")): tensors are CPU tensors, device memory is the
CPU backend's memfd VMM, graphs record host ops (SimGraph). What it enforces, so that the
device layer's failure paths run in CI:
- a device synchronize (and empty_cache, which synchronizes) fails while any stream
  captures, from any thread and in every mode, without invalidating the capture (ACL
  107027); a stream synchronize fails only on a capturing stream;
- memory that replays queued since the last synchronize may still touch is never unmapped
  (a GPU would fault: the simulated driver refuses);
- the caching allocators' pool rules (sim.caching): use counts, the `use_count > 0` assert
  of a capture on a pool every graph released, routing left behind by a failed begin/end;
- dropping a MemPool while any stream captures is recorded as a violation (torch_npu's
  destructor throws there and aborts the process);
- faults: `faults.inject(call, code)` makes "capture_begin", "capture_end" (the stream
  leaves capture all the same), "capture_end_refused" (refused before the end runs: the
  stream keeps capturing), "end_capture" (the driver's own end of a capture), "replay" or
  "malloc" fail.
`books()` counts what must go back (routes, pools, memory); `violations` lists broken rules.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from xgraph.backends.cpu import HostVirtualMemory, host_tensor
from xgraph.device.runtime import PoolId, TorchRuntime
from xgraph.interfaces import Launch, PhysicalChunk

from .caching import SimCachingAllocator, SimMemPool, SimPluggableAllocator
from .faults import Faults
from .graph import SimGraph
from .streams import Queued, SimStream, SimStreams

DEFAULT_CAPACITY = 32 << 30  # the simulated device's memory (mem_get_info total)
GRANULARITY = 64 << 10
CODE_NAMES = {
    1: "SIM_ERROR_STREAM_CAPTURED",
    2: "SIM_ERROR_OUT_OF_MEMORY",
    3: "SIM_ERROR_CAPTURE_INVALIDATED",
    9: "SIM_ERROR_INJECTED",
}


class SimError(RuntimeError):
    """A failed call of the simulated runtime (torch raises RuntimeError), with its code."""

    def __init__(self, code: int, call: str, detail: str = "") -> None:
        self.code, self.call = code, call
        name = CODE_NAMES.get(code, f"error {code}")
        super().__init__(f"{call} failed: {name} ({code}){': ' if detail else ''}{detail}")


class SimDeviceMemory(HostVirtualMemory):
    """The simulated device's memory: refuses to unmap or free while replays are queued."""

    def _quiesce(self) -> None:
        """The driver does not wait for queued work: the caller synchronizes first."""


class SimRuntime(TorchRuntime):
    """One simulated device; `faults`, `caching`, `memory` and `books()` are for tests."""

    name = "simulated"
    STREAM_CAPTURED, OUT_OF_MEMORY = 1, 2  # the codes the runtime raises (a driver's own)
    error_type: type[Exception] = SimError
    streams_type: type[SimStreams] = SimStreams
    graph_type: type[SimGraph] = SimGraph

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        granularity: int = GRANULARITY,
        *,
        faults: Faults | None = None,
        memory: HostVirtualMemory | None = None,
        refuse_host_reads: bool = False,
    ) -> None:
        self.device = torch.device("cpu")
        self.refuse_host_reads = refuse_host_reads  # CUDA's rule, for a backend that claims it
        self.device_index = 0
        self.capacity = capacity
        self.faults = faults or Faults()
        self.violations: list[str] = []
        self.memory = memory or SimDeviceMemory(self, granularity)  # the device's memory
        self.streams = self.streams_type(self.stream_synchronize)
        self.caching = SimCachingAllocator(self)
        self._mallocs: dict[int, PhysicalChunk] = {}
        self._lock = threading.Lock()

    # -- the simulator's own -----------------------------------------------------------------

    def error(self, code: int, call: str, detail: str = "") -> Exception:
        return self.error_type(code, call, detail)

    def check_fault(self, call: str) -> None:
        code = self.faults.check(call)
        if code:
            raise self.error(code, call, "injected failure")

    def violation(self, why: str) -> None:
        self.violations.append(why)

    @property
    def queued(self) -> int:
        """Replays issued since their stream last synchronized (the VMM refuses to unmap)."""
        return self.streams.queued()

    def mark_busy(self) -> Queued:
        """Work was issued on the current stream (a replay); it may run until that stream
        synchronizes."""
        stream = self.streams.current()
        stream.queued += 1
        return Queued(stream)

    def _refuse_while_capturing(self, call: str) -> None:
        capturing = self.streams.capturing()
        if capturing:
            raise self.error(
                self.STREAM_CAPTURED, call, f"{len(capturing)} stream(s) of the device capture"
            )

    # -- streams ---------------------------------------------------------------------------

    def synchronize(self) -> None:
        self._refuse_while_capturing("synchronize")
        for s in self.streams.all():
            s.settle()

    def stream_synchronize(self, stream: SimStream) -> None:
        if stream.capture is not None:
            raise self.error(self.STREAM_CAPTURED, "stream synchronize", "the stream captures")
        stream.settle()

    def new_stream(self) -> SimStream:
        return self.streams.new()

    def current_stream(self) -> SimStream:
        return self.streams.current()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.streams.use(stream)

    def is_capturing(self, stream: Any) -> bool:
        return stream.capture is not None

    # -- graphs and pools ------------------------------------------------------------------

    def new_graph(self) -> SimGraph:
        return self.graph_type(self)

    def new_mempool(self, allocator: Any | None) -> Any:
        return SimMemPool(self, allocator)

    def readable_graph(self) -> SimGraph:
        g = self.graph_type(self)
        g.keep = True
        return g

    def graph_launches(self, graph: Any) -> list[Launch]:
        return graph.launches()

    def custom_allocator(self, alloc_fn: int, free_fn: int) -> SimPluggableAllocator:
        return SimPluggableAllocator(alloc_fn, free_fn, self.device_index)

    def use_mem_pool(self, mempool: Any) -> contextlib.AbstractContextManager[Any]:
        """torch's use_mem_pool: the block's tensors land in the pool's blocks."""
        return self.caching.use_mem_pool(tuple(mempool.id))

    def end_allocate_to_pool(self, pool_id: PoolId) -> None:
        self.caching.end_allocate_to_pool(pool_id)

    def release_pool(self, pool_id: PoolId) -> None:
        self.caching.release_pool(pool_id)

    def memory_snapshot(self) -> list[dict[str, Any]]:
        return self.caching.snapshot()

    def end_capture(self, stream: Any) -> bool:
        if self.faults.check("end_capture") or stream.capture is None:
            return False
        stream.capture.stop()
        return True

    def drop_mempool(self, pool_id: PoolId, holds_use: bool) -> None:
        """A MemPool's destructor: its use goes, its pool's cache is emptied (synchronizing)."""
        if self.streams.capturing():
            self.violation(
                f"MemPool {pool_id} was dropped while a stream captures (its destructor "
                "synchronizes the device, which throws inside it: the process aborts)"
            )
            return
        if holds_use:
            self.caching.release_pool(pool_id)

    # -- memory ----------------------------------------------------------------------------

    def device_malloc(self, nbytes: int) -> int:
        """Plain device memory for the caching allocator's segments; 0 when full."""
        gran = self.memory.granularity
        size = -(-nbytes // gran) * gran
        if self.faults.check("malloc") or self.memory.physical_bytes() + size > self.capacity:
            return 0
        with self._lock:
            address = self.memory.reserve(size)
            chunk = self.memory.create(size)
            self.memory.map(address, chunk)
            self._mallocs[address] = chunk
        return address

    def device_free(self, address: int) -> None:
        with self._lock:
            chunk = self._mallocs.pop(address)
            self.memory.unmap(address)
            self.memory.free(chunk)
            self.memory.release(address)

    def out_of_memory(self, nbytes: int, what: str) -> Exception:
        return self.error(
            self.OUT_OF_MEMORY,
            "malloc",
            f"out of memory: tried to allocate {nbytes} bytes for {what}",
        )

    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return host_tensor(address, nbytes)

    def mem_get_info(self) -> tuple[int, int]:
        return self.capacity - self.memory.physical_bytes(), self.capacity

    def empty_cache(self) -> None:
        self._refuse_while_capturing("empty_cache")  # it synchronizes the device
        self.caching.empty_cache()

    def books(self) -> dict[str, int]:
        """Live objects that must go back: routes, pools, plain allocations and VMM books."""
        return {
            "routes": self.caching.routes(),
            "pools": self.caching.pools(),
            "mallocs": len(self._mallocs),
            **self.memory.live(),
        }
