"""torch's caching allocators as graphs see them: private pools, MemPools, pluggable allocators.

- A private pool (one per MemPool or graph pool id) is a HostCachingPool whose segments come
  from the pool's pluggable allocator or from the device. Its use count is its MemPool's
  use plus one per graph captured on it; at zero it gives its segments back once no block
  of it is alive, and until then a capture that begins on it fails torch's
  `TORCH_INTERNAL_ASSERT(use_count > 0)`.
- Capture routes the capturing thread's device allocations to the pool (begin / end allocate
  to pool); a route left behind by a failed capture makes that thread's next capture fail,
  as a stray route would misplace allocations on a device. Bindings undo it.
- The pinned-host allocator keeps a record of each graph pool of its own: a capture takes a
  use (its graph's reset gives it back) and routes the pool id until its capture_end
  completes. The record stays at zero uses, so a capture on a pool whose every graph was reset
  asserts here too (what a keeper graph prevents), and no binding removes a routing that a
  failed begin or end left: that pool id is "already recording" from then on.
- A pluggable allocator is two C function pointers called through ctypes (the prototypes of
  xgraph.routing), so an adapter's real callbacks run.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xgraph.backends.cpu import HostCachingPool, PlaceInPool
from xgraph.routing import ALLOC_FN, FREE_FN

if TYPE_CHECKING:
    from .runtime import SimRuntime

PoolId = tuple[int, int]
_uids = itertools.count(1)


def mempool_id() -> PoolId:
    """A fresh MemPool id, (0, n) as torch makes them."""
    return (0, next(_uids))


def graph_pool_id() -> PoolId:
    """A fresh private pool id of a graph captured without a pool, (n, 0) as torch makes them."""
    return (next(_uids), 0)


class SimPluggableAllocator:
    """torch's pluggable allocator over raw function pointers (`_cuda_customAllocator`)."""

    def __init__(self, alloc_fn: int, free_fn: int, device_index: int = 0) -> None:
        self._alloc = ALLOC_FN(alloc_fn)
        self._free = FREE_FN(free_fn)
        self._device = device_index
        self._meta: dict[int, tuple[int, int]] = {}  # ptr -> (size, stream)

    def malloc(self, size: int, stream: int) -> int:
        ptr = int(self._alloc(size, self._device, stream) or 0)
        self._meta[ptr] = (size, stream)  # recorded even for NULL, as torch does
        return ptr

    def free(self, ptr: int) -> None:
        meta = self._meta.pop(ptr, None)
        if meta is None:
            raise RuntimeError("Trying to free a pointer not allocated here")
        self._free(ptr, meta[0], self._device, meta[1])


@dataclass(eq=False)
class PrivatePool:
    id: PoolId
    allocator: SimPluggableAllocator | None
    uses: int
    cache: HostCachingPool = field(init=False)
    origins: dict[int, str] = field(default_factory=dict)  # segment -> "allocator" | "device"
    freers: dict[int, Any] = field(default_factory=dict)  # segment -> its allocator


class _Segments:
    """The SegmentAllocator a private pool's HostCachingPool draws from."""

    def __init__(self, owner: SimCachingAllocator, pool: PrivatePool) -> None:
        self.owner, self.pool = owner, pool

    def alloc(self, nbytes: int) -> int:
        return self.owner.segment_alloc(self.pool, nbytes)

    def free(self, address: int, nbytes: int) -> None:
        self.owner.segment_free(self.pool, address)


class SimCachingAllocator:
    """Private pools, use counts, per-thread routing and the host records of one device."""

    #: whether a pool's last release gives its segments back at once (as a MemPool's
    #: destructor, which empties its pool, does); False: they wait for an empty_cache
    frees_on_release = True

    def __init__(self, runtime: SimRuntime) -> None:
        self.runtime = runtime
        self._lock = threading.RLock()
        self._pools: dict[PoolId, PrivatePool] = {}
        self._routes: dict[int, PoolId] = {}  # thread -> pool id
        self._host_uses: dict[PoolId, int] = {}
        self._host_routed: set[PoolId] = set()

    # -- pools -----------------------------------------------------------------------------

    def create_or_incref(self, pool_id: PoolId, allocator: Any = None) -> PrivatePool:
        with self._lock:
            pool = self._pools.get(pool_id)
            if pool is None:
                pool = PrivatePool(pool_id, allocator, 0)
                pool.cache = HostCachingPool(self.runtime.memory, _Segments(self, pool))
                self._pools[pool_id] = pool
            elif pool.uses == 0:
                raise RuntimeError(
                    f"TORCH_INTERNAL_ASSERT failed: use_count > 0 (pool {pool_id} was released "
                    "by every graph but is still cached: live blocks, or no empty_cache since; "
                    "a capture cannot share it)"
                )
            pool.uses += 1
            return pool

    def use_count(self, pool_id: PoolId) -> int:
        with self._lock:
            pool = self._pools.get(pool_id)
            return pool.uses if pool is not None else 0

    def release_pool(self, pool_id: PoolId) -> None:
        """Drop one use; at zero the pool's segments go back once none of its blocks lives
        (where `frees_on_release`, else at the next empty_cache)."""
        with self._lock:
            pool = self._pools.get(pool_id)
            if pool is None or pool.uses <= 0:
                raise RuntimeError(f"releasePool: no use of pool {pool_id} left to release")
            pool.uses -= 1
        if self.frees_on_release:
            self.empty_cache(pool_id)

    def empty_cache(self, pool_id: PoolId | None = None) -> None:
        """Give back the segments of released pools (one, or all) none of whose blocks lives."""
        with self._lock:
            ids = [pool_id] if pool_id is not None else list(self._pools)
            done = [
                self._pools.pop(i)
                for i in ids
                if i in self._pools
                and self._pools[i].uses == 0
                and not self._pools[i].cache.live_blocks()
            ]
        for pool in done:
            pool.cache.close()

    def pool_bytes(self, pool_id: PoolId) -> int:
        with self._lock:
            pool = self._pools.get(pool_id)
            return pool.cache.reserved_bytes() if pool is not None else 0

    def snapshot(self, pool_id: PoolId | None = None) -> list[dict[str, Any]]:
        """Segments in torch.cuda.memory_snapshot's format (one pool's, or every pool's)."""
        with self._lock:
            pools = [p for i, p in self._pools.items() if pool_id in (None, i)]
            return [
                {"segment_pool_id": p.id, "total_size": p.cache.reserved_bytes()} for p in pools
            ]

    def pools(self) -> int:
        with self._lock:
            return len(self._pools)

    # -- device routing --------------------------------------------------------------------

    def begin_allocate_to_pool(self, pool_id: PoolId) -> PrivatePool:
        tid = threading.get_ident()
        with self._lock:
            if tid in self._routes:
                raise RuntimeError(
                    f"beginAllocateToPool: this thread's allocations still go to pool "
                    f"{self._routes[tid]} (an earlier capture was not ended and its routing "
                    "not undone); end it with endAllocateToPool first"
                )
            pool = self.create_or_incref(pool_id)
            self._routes[tid] = pool_id
            return pool

    def end_allocate_to_pool(self, pool_id: PoolId) -> None:
        tid = threading.get_ident()
        with self._lock:
            if self._routes.get(tid) != tuple(pool_id):
                raise RuntimeError(f"endAllocateToPool: not currently recording to {pool_id}")
            del self._routes[tid]

    def routes(self) -> int:
        with self._lock:
            return len(self._routes)

    def use_mem_pool(self, pool_id: PoolId) -> PlaceInPool:
        """The block's allocations go to the pool (what use_mem_pool routes on a device)."""
        with self._lock:
            pool = self._pools.get(pool_id)
        if pool is None:
            raise RuntimeError(f"use_mem_pool: no pool {pool_id}")
        return PlaceInPool(pool.cache)

    # -- the pinned-host allocator's records -----------------------------------------------

    def host_begin(self, pool_id: PoolId) -> None:
        with self._lock:
            if pool_id in self._host_routed:
                raise RuntimeError(
                    f"beginAllocateToPool: already recording to mempool_id {pool_id} (the "
                    "host allocator; a failed capture_begin or capture_end left it routed)"
                )
            if self._host_uses.get(pool_id, 1) == 0:
                raise RuntimeError(
                    f"TORCH_INTERNAL_ASSERT failed: use_count > 0 (the host allocator's record "
                    f"of pool {pool_id}: every graph captured on it was reset)"
                )
            self._host_uses[pool_id] = self._host_uses.get(pool_id, 0) + 1
            self._host_routed.add(pool_id)

    def host_end(self, pool_id: PoolId) -> None:
        with self._lock:
            self._host_routed.discard(pool_id)

    def host_release(self, pool_id: PoolId) -> None:
        with self._lock:
            self._host_uses[pool_id] -= 1  # the record stays (erased by host_empty_cache)

    def host_routed(self) -> set[PoolId]:
        """Pool ids the host allocator still records to (left by failed captures)."""
        with self._lock:
            return set(self._host_routed)

    # -- segments --------------------------------------------------------------------------

    def allocator_for(self, pool: PrivatePool) -> Any:
        """The pluggable allocator a segment of `pool` comes from, or None (the device)."""
        return pool.allocator

    def segment_alloc(self, pool: PrivatePool, nbytes: int) -> int:
        rt = self.runtime
        allocator = self.allocator_for(pool)
        if allocator is not None:
            ptr, origin = allocator.malloc(nbytes, rt.streams.current().handle), "allocator"
            pool.freers[ptr] = allocator
        else:
            ptr, origin = rt.device_malloc(nbytes), "device"
        if not ptr:
            raise rt.out_of_memory(nbytes, f"graph pool {pool.id} ({origin} returned NULL)")
        pool.origins[ptr] = origin
        return ptr

    def segment_free(self, pool: PrivatePool, address: int) -> None:
        if pool.origins.pop(address) == "allocator":
            pool.freers.pop(address).free(address)
        else:
            self.runtime.device_free(address)


class SimMemPool:
    """torch.cuda.MemPool: a pool id and, optionally, its allocator; it holds a use of the pool."""

    def __init__(self, runtime: SimRuntime, allocator: Any = None) -> None:
        self._runtime = runtime
        self.allocator = allocator
        self.id = mempool_id()
        runtime.caching.create_or_incref(self.id, allocator)

    def use_count(self) -> int:
        return self._runtime.caching.use_count(self.id)

    def snapshot(self) -> list[dict[str, Any]]:
        return self._runtime.caching.snapshot(self.id)

    def __del__(self) -> None:
        try:  # releases its use and empties the pool's cache, as torch's destructor does
            self._runtime.drop_mempool(self.id, holds_use=True)
        except Exception:
            pass
