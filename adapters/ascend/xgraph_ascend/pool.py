"""The Ascend capture pool: a torch_npu MemPool, native or routed.

- native (segments=None): torch_npu's caching allocator takes segments with aclrtMalloc;
- routed (segments=a SegmentAllocator): the MemPool's allocator is xgraph's process-wide one
  (xgraph.routing, via allocator.get_allocator), and `capturing()` routes this thread's
  segment requests to `segments`. Routed pools exist only in the owner era, where the pool
  frees through its allocator (the backend refuses them otherwise, see segments_support).
Graphs captured on the pool hold a use of it until reset. Dropping the MemPool releases its
own use; torch_npu gives the pool's segments back once no use is left.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from xgraph.interfaces import CapturePool, SegmentAllocator
from xgraph.routing import handed_out, routing

from .allocator import get_allocator
from .runtime import NpuRuntime, PoolId

logger = logging.getLogger("xgraph")


class AscendCapturePool(CapturePool):
    """A MemPool for captures; `.id` goes to NPUGraph.capture_begin."""

    def __init__(self, runtime: NpuRuntime, segments: SegmentAllocator | None = None) -> None:
        super().__init__(segments)
        self.runtime = runtime
        allocator = get_allocator(runtime) if segments is not None else None
        self._mempool: Any = runtime.new_mempool(allocator)
        self.id: PoolId = tuple(self._mempool.id)  # type: ignore[assignment]

    def use_count(self) -> int:
        """The caching allocator's uses of the pool: the MemPool, +1 per graph holding it."""
        if self._mempool is None:
            return 0
        return self.runtime.mempool_use_count(self._mempool)

    def reserved_bytes(self) -> int:
        if self.segments is not None:
            return handed_out(self.segments)
        if self._mempool is None:
            return 0
        return self.runtime.pool_bytes(self.id, self._mempool)

    def capturing(self) -> contextlib.AbstractContextManager[Any]:
        """torch_npu never says which capture asks for a segment: route this thread's asks."""
        if self.segments is None:
            return contextlib.nullcontext()
        return routing(self.segments)

    def allocating(self) -> contextlib.AbstractContextManager[Any] | None:
        """This thread's NPU allocations in the block come from the pool, their segments from
        `segments` (xgraph.memory_region: the runtime's use_mem_pool, routed)."""
        if self.segments is None:
            return None
        return _allocating(self.runtime, self._mempool, self.segments)

    def _release(self) -> None:
        """Drop the MemPool; its segments go back once graphs captured on it are reset."""
        held = self.use_count() - 1
        if held > 0:
            logger.warning(
                "AscendCapturePool.close: %d graph(s) captured on pool %s were not reset; its "
                "memory is released once they are (reset graphs before closing their pool).",
                held,
                self.id,
            )
        self._mempool = None  # the MemPool's destructor releases its use of the pool

    def __repr__(self) -> str:
        kind = "routed" if self.segments is not None else "native"
        return f"<AscendCapturePool {kind} id={self.id} {'closed' if self.closed else 'open'}>"


@contextlib.contextmanager
def _allocating(runtime: NpuRuntime, mempool: Any, segments: SegmentAllocator) -> Iterator[None]:
    with routing(segments), runtime.use_mem_pool(mempool):
        yield
