"""TorchRuntime: a torch device as the device layer drives it, one call per line.

The port lists what a torch device module (torch.cuda, torch_npu's torch.npu) offers a graph
runtime: streams, the graph object, MemPools over a pluggable allocator, the pool bindings
torch keeps private, raw memory as a tensor, memory info. An adapter writes it as one-liners
over its torch module; `xgraph.testing.sim.SimRuntime` is a simulated one that enforces the
rules real runtimes break on, so the failure paths of the layer run in CI. The layer above
it (`StreamGraph`, `MemPoolCapturePool`, `TorchBackend`) is written once, for every device.

What the port expects of the objects it returns:
- a stream: `wait_stream(other)` and `synchronize()` (this stream only);
- a graph: `capture_begin(pool=id, capture_error_mode=...)`, `capture_end()`, `replay()`,
  `reset()` (torch.cuda.CUDAGraph's methods);
- a MemPool: `.id` (a pair of ints); `use_count()` and `snapshot()` where torch has them.
Optional pairs keep working defaults: `end_capture` (False: no driver call), and
`readable_graph` / `graph_launches` (None: recordings cannot be read).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..interfaces import Launch

PoolId = tuple[int, int]


class TorchRuntime(ABC):
    """One torch device: streams, graphs, MemPools and memory (one object per device)."""

    device: torch.device

    # -- streams ---------------------------------------------------------------------------

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all work queued on the device has finished (device-wide)."""

    @abstractmethod
    def new_stream(self) -> Any:
        """A new non-default stream of the device."""

    @abstractmethod
    def current_stream(self) -> Any:
        """This thread's current stream of the device."""

    @abstractmethod
    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Make `stream` (and its device) current in this thread for the block."""

    @abstractmethod
    def is_capturing(self, stream: Any) -> bool:
        """Whether `stream` is capturing a graph now."""

    # -- graphs and pools ------------------------------------------------------------------

    @abstractmethod
    def new_graph(self) -> Any:
        """A fresh torch graph object (torch.cuda.CUDAGraph's interface)."""

    @abstractmethod
    def new_mempool(self, allocator: Any | None) -> Any:
        """A MemPool of the device, drawing segments from `allocator` when given."""

    @abstractmethod
    def custom_allocator(self, alloc_fn: int, free_fn: int) -> Any:
        """torch's pluggable allocator over two C function pointers (xgraph.routing's)."""

    def use_mem_pool(self, mempool: Any) -> AbstractContextManager[Any] | None:
        """Optional: a context in which this thread's allocations on the device come from
        `mempool` (torch.cuda.use_mem_pool), for memory regions (`xgraph.memory_region`);
        None where the runtime has no such call (regions are then refused). Default None."""
        return None

    @abstractmethod
    def end_allocate_to_pool(self, pool_id: PoolId) -> None:
        """Stop routing this thread's allocations to the pool; raises if they were not."""

    @abstractmethod
    def release_pool(self, pool_id: PoolId) -> None:
        """Drop one use of the pool, as a graph's reset does."""

    @abstractmethod
    def memory_snapshot(self) -> list[dict[str, Any]]:
        """The caching allocator's segments (torch.cuda.memory_snapshot's format)."""

    def readable_graph(self) -> Any | None:
        """Optional: a fresh torch graph whose recording `graph_launches` can read after
        capture_end (CUDA: `CUDAGraph(keep_graph=True)`); None (the default): this runtime
        cannot read what its graphs record, and the parameterization check says so."""
        return None

    def graph_launches(self, graph: Any) -> list[Launch]:
        """Optional, with readable_graph: the launches a captured readable graph records, in
        order (kernels with grid, block, shared memory and non-pointer argument bytes)."""
        raise NotImplementedError

    def end_capture(self, stream: Any) -> bool:
        """End the capture on `stream` through the driver, dropping what it recorded, when the
        torch graph could not; False where the runtime has no such call."""
        return False

    # -- memory ----------------------------------------------------------------------------

    @abstractmethod
    def as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 device tensor over `nbytes` at `address` (memory the caller keeps alive)."""

    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory as the driver sees them."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Give the default allocator's cached, unused memory back to the driver."""
