"""torch_npu's caching allocator as graphs see it: the core simulator's, in two eras.

The pools, use counts, routing and host records are `xgraph.testing.sim`'s. What torch_npu
adds is its memory-pool era (docs/ascend.md, 'memory-pool eras'):
- OWNER (>= 2.13): each segment comes from the pool's allocator and goes back through it;
  the MemPool holds a use of its pool.
- CONTEXT (<= 2.12): allocations reach the MemPool's allocator only inside
  MemPoolContext(pool), and every segment is freed with a bare aclrtFree (return code
  ignored); the MemPool holds no use of its pool and has neither `use_count` nor
  `snapshot`, and its destructor does nothing. A pool all of whose graphs were reset is
  only marked freeable (releasePool): its segments stay cached until an empty_cache
  (AP-2.10 NPUCachingAllocator.cpp:2825-2837), and a capture on it until then hits the
  `use_count > 0` assert (:2141-2153).
Plain device segments come from (simulated) aclrtMalloc, 2 MiB granular.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from xgraph.testing.sim import PrivatePool, SimCachingAllocator, mempool_id

from ..runtime import PoolEra

if TYPE_CHECKING:
    from .runtime import SimRuntime

__all__ = ["NpuCachingAllocator", "PrivatePool", "SimContextMemPool"]


class NpuCachingAllocator(SimCachingAllocator):
    """The core simulator's caching allocator with torch_npu's era rules."""

    runtime: SimRuntime

    def __init__(self, runtime: SimRuntime) -> None:
        super().__init__(runtime)
        self._context = threading.local()  # MemPoolContext stack (CONTEXT era)

    @property  # type: ignore[override]
    def frees_on_release(self) -> bool:
        """Owner era: the MemPool's destructor empties its pool. Context era: nothing does
        until an empty_cache."""
        return self.runtime.era is PoolEra.OWNER

    @contextlib.contextmanager
    def mempool_context(self, mempool: Any) -> Iterator[None]:
        """MemPoolContext(pool): CONTEXT-era routing of segments to the MemPool's allocator."""
        if self.runtime.era is not PoolEra.CONTEXT:
            raise AttributeError("torch_npu.npu.memory has no MemPoolContext in the owner era")
        stack = self._context.__dict__.setdefault("stack", [])
        stack.append(mempool)
        try:
            yield
        finally:
            stack.pop()

    def allocator_for(self, pool: PrivatePool) -> Any:
        if self.runtime.era is PoolEra.OWNER:
            return pool.allocator
        stack = getattr(self._context, "stack", [])
        return stack[-1].allocator if stack and tuple(stack[-1].id) == pool.id else None

    def segment_free(self, pool: PrivatePool, address: int) -> None:
        if self.runtime.era is PoolEra.OWNER:
            super().segment_free(pool, address)
            return
        pool.origins.pop(address)  # torch_npu frees with a bare aclrtFree, code ignored
        self.runtime.acl.aclrtFree(address)


class SimContextMemPool:
    """A CONTEXT-era torch_npu MemPool: an id and an allocator; it holds no use of its pool
    (the first capture on the id makes the pool) and its destructor does nothing."""

    def __init__(self, allocator: Any = None) -> None:
        self.allocator = allocator
        self.id = mempool_id()
