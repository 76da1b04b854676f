"""torch_npu's caching allocator as graphs see it: private pools, MemPools, pluggable allocators.

- A private pool (one per MemPool or graph pool id) is a HostCachingPool whose segments come
  from the pool's pluggable allocator or from (simulated) aclrtMalloc; it has a use count
  (the MemPool, +1 per graph captured on it) and gives its segments back at zero.
- Capture routes the capturing thread's allocations to the pool (begin/end allocate to
  pool); a route left behind by a failed capture makes the thread's next capture fail here,
  as a stray route would misplace allocations on an NPU.
- A pluggable allocator is two C function pointers, cast back to torch_npu's prototypes and
  called through ctypes: the adapter's real callbacks run.
- Eras: OWNER frees each segment through the allocator that gave it. CONTEXT routes
  allocation to the allocator only inside MemPoolContext(pool), and frees every segment
  with aclrtFree (return code ignored), as torch_npu <= 2.12 does.
Segment sizes are rounded to 2 MiB (torch_npu's 20 MiB large-segment class is not modelled).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xgraph.backends.cpu import HostCachingPool, PlaceInPool

from .. import acl
from ..errors import AclRuntimeError
from ..runtime import PoolEra

if TYPE_CHECKING:
    from .libacl import SimAcl
    from .streams import SimStreams

_uids = itertools.count(1)
MEMORY_ALLOCATION = 207001


class SimPluggableAllocator:
    """NPUPluggableAllocator over raw function pointers (torch_npu._C._npu_customAllocator)."""

    def __init__(self, alloc_fn: int, free_fn: int, device_index: int) -> None:
        self._alloc = acl.PLUGGABLE_ALLOC(alloc_fn)
        self._free = acl.PLUGGABLE_FREE(free_fn)
        self._device = device_index
        self._meta: dict[int, tuple[int, int]] = {}  # ptr -> (size, stream)

    def malloc(self, size: int, stream: int) -> int:
        ptr = int(self._alloc(size, self._device, stream) or 0)
        self._meta[ptr] = (size, stream)  # recorded even for NULL, as torch_npu does
        return ptr

    def free(self, ptr: int) -> None:
        meta = self._meta.pop(ptr, None)
        if meta is None:
            raise RuntimeError("Trying to free a pointer not allocated here")
        self._free(ptr, meta[0], self._device, meta[1])


@dataclass(eq=False)
class PrivatePool:
    id: tuple[int, int]
    allocator: SimPluggableAllocator | None
    uses: int
    cache: HostCachingPool = field(init=False)
    origins: dict[int, str] = field(default_factory=dict)  # segment -> "allocator" | "device"


class _Segments:
    """The SegmentAllocator a private pool's HostCachingPool draws from."""

    def __init__(self, owner: SimCachingAllocator, pool: PrivatePool) -> None:
        self.owner, self.pool = owner, pool

    def alloc(self, nbytes: int) -> int:
        return self.owner.segment_alloc(self.pool, nbytes)

    def free(self, address: int, nbytes: int) -> None:
        self.owner.segment_free(self.pool, address)


class SimCachingAllocator:
    """Private pools, use counts and per-thread routing of one simulated device."""

    def __init__(self, sim_acl: SimAcl, streams: SimStreams, era: PoolEra) -> None:
        self.acl, self.streams, self.era = sim_acl, streams, era
        self._lock = threading.RLock()
        self._pools: dict[tuple[int, int], PrivatePool] = {}
        self._routes: dict[int, tuple[int, int]] = {}  # thread -> pool id
        self._context = threading.local()  # MemPoolContext stack (CONTEXT era)

    # -- pools -----------------------------------------------------------------------------

    def create_or_incref(self, pool_id: tuple[int, int], allocator: Any = None) -> PrivatePool:
        with self._lock:
            pool = self._pools.get(pool_id)
            if pool is None:
                pool = PrivatePool(pool_id, allocator, 0)
                pool.cache = HostCachingPool(self.acl.hbm, _Segments(self, pool))
                self._pools[pool_id] = pool
            pool.uses += 1
            return pool

    def use_count(self, pool_id: tuple[int, int]) -> int:
        with self._lock:
            pool = self._pools.get(pool_id)
            return pool.uses if pool is not None else 0

    def release_pool(self, pool_id: tuple[int, int]) -> None:
        """Drop one use; at zero the pool's segments go back (through its free path)."""
        with self._lock:
            pool = self._pools.get(pool_id)
            if pool is None:
                raise RuntimeError(f"releasePool: no pool {pool_id} (released too often)")
            pool.uses -= 1
            if pool.uses > 0:
                return
            del self._pools[pool_id]
        pool.cache.close()

    def pool_bytes(self, pool_id: tuple[int, int]) -> int:
        with self._lock:
            pool = self._pools.get(pool_id)
            return pool.cache.reserved_bytes() if pool is not None else 0

    # -- routing ---------------------------------------------------------------------------

    def begin_allocate_to_pool(self, pool_id: tuple[int, int]) -> PrivatePool:
        tid = threading.get_ident()
        with self._lock:
            if tid in self._routes:
                raise RuntimeError(
                    f"beginAllocateToPool: this thread's allocations still go to pool "
                    f"{self._routes[tid]} (an earlier capture was not ended and its routing "
                    "not undone); end it with endAllocateToPool first"
                )
            self._routes[tid] = pool_id
            return self.create_or_incref(pool_id)

    def end_allocate_to_pool(self, pool_id: tuple[int, int]) -> None:
        tid = threading.get_ident()
        with self._lock:
            if self._routes.get(tid) != tuple(pool_id):
                raise RuntimeError(f"endAllocateToPool: not currently recording to {pool_id}")
            del self._routes[tid]

    def routes(self) -> int:
        with self._lock:
            return len(self._routes)

    @contextlib.contextmanager
    def mempool_context(self, pool_id: tuple[int, int]) -> Iterator[None]:
        """MemPoolContext(pool): CONTEXT-era routing of segments to the pool's allocator."""
        if self.era is not PoolEra.CONTEXT:
            raise AttributeError("torch_npu.npu.memory has no MemPoolContext in the owner era")
        stack = self._context.__dict__.setdefault("stack", [])
        stack.append(pool_id)
        try:
            yield
        finally:
            stack.pop()

    def use_mem_pool(self, pool_id: tuple[int, int]) -> contextlib.AbstractContextManager[Any]:
        """Allocations of the block go to the pool (what use_mem_pool routes on an NPU)."""
        with self._lock:
            pool = self._pools.get(tuple(pool_id))  # type: ignore[call-overload]
        if pool is None:
            raise RuntimeError(f"use_mem_pool: no pool {pool_id}")
        return PlaceInPool(pool.cache)

    # -- segments --------------------------------------------------------------------------

    def _use_allocator(self, pool: PrivatePool) -> bool:
        if pool.allocator is None:
            return False
        if self.era is PoolEra.OWNER:
            return True
        stack = getattr(self._context, "stack", [])
        return bool(stack) and stack[-1] == pool.id

    def segment_alloc(self, pool: PrivatePool, nbytes: int) -> int:
        stream = self.streams.current().handle
        if self._use_allocator(pool):
            assert pool.allocator is not None
            ptr = pool.allocator.malloc(nbytes, stream)
            origin = "allocator"
        else:
            out = ctypes.c_void_p()
            rc = self.acl.functions.aclrtMalloc(ctypes.byref(out), nbytes, 0)
            ptr = 0 if rc else int(out.value or 0)
            origin = "device"
        if not ptr:
            raise AclRuntimeError(
                MEMORY_ALLOCATION,
                "NPUCachingAllocator",
                f"NPU out of memory: tried to allocate {nbytes} bytes for graph pool {pool.id} "
                f"({origin} returned NULL)",
            )
        pool.origins[ptr] = origin
        return ptr

    def segment_free(self, pool: PrivatePool, address: int) -> None:
        origin = pool.origins.pop(address)
        if self.era is PoolEra.OWNER and origin == "allocator":
            assert pool.allocator is not None
            pool.allocator.free(address)
        else:  # torch_npu frees with a bare aclrtFree and ignores its return code
            self.acl.functions.aclrtFree(address)


class SimMemPool:
    """torch_npu.npu.memory.MemPool: a pool id (0, n) and, optionally, its allocator."""

    def __init__(self, caching: SimCachingAllocator, allocator: Any = None) -> None:
        self._caching = caching
        self.allocator = allocator
        self.id = (0, next(_uids))
        caching.create_or_incref(self.id, allocator)

    def use_count(self) -> int:
        return self._caching.use_count(self.id)

    def __del__(self) -> None:
        try:  # the destructor releases the pool, as torch_npu's MemPool does
            self._caching.release_pool(self.id)
        except Exception:
            pass
