"""Sleep and wake of a SharedPhysicalPool: every physical chunk given back, every capture's
address range kept.

Graph memory holds no state between replays (each replay writes its intermediates before
reading them, and outputs are copied into persistent buffers inside the capture), so
nothing of it is saved. `sleep_pool` unmaps every space's chunks, last first, covers what
the space had mapped with the VirtualMemory's scratch chunk (`CheckedVirtualMemory.cover`:
a tensor of graph memory touched while asleep reads and writes the scratch instead of
faulting), and frees the chunk list, booking each call as it succeeds; the extent of each
space and the number of chunks are remembered. `wake_pool` creates that many chunks again,
uncovers each space and maps chunk k at base + k * chunk of every space that had it: the
same addresses, so every graph captured over the pool replays unchanged. A wake that fails
goes back to where it started (its mappings undone, its covers made again, its chunks
freed) and raises; the pool stays asleep and a later wake starts over. While asleep the
pool refuses to grow (`SharedPhysicalPool.grow`). Closing a sleeping pool releases each
space with its cover (a reservation takes its covers with it).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from .errors import PoolClosedError
from .pool import AddressSpace, SharedPhysicalPool


@dataclass
class _Extent:
    """What a sleeping pool held: chunks [0, mapped) of each space, and how many chunks;
    and the spaces whose extent the scratch chunk covers now."""

    mapped: dict[AddressSpace, int]
    chunks: int
    covered: set[AddressSpace] = field(default_factory=set)


_asleep: weakref.WeakKeyDictionary[SharedPhysicalPool, _Extent] = weakref.WeakKeyDictionary()


def sleep_pool(pool: SharedPhysicalPool) -> int:
    """Unmap and free every chunk, keep every reservation; returns the bytes given back.

    Idempotent; after a driver failure, calling it again finishes the job. Synchronize the
    device first (the VirtualMemory waits again before each unmap and free)."""
    with pool._lock:
        extent = _asleep.get(pool)
        if extent is None:
            if pool.closed:
                raise PoolClosedError("sleep: the SharedPhysicalPool is closed.")
            extent = _Extent({s: s.mapped for s in pool.spaces if not s.closed}, len(pool.chunks))
            _asleep[pool] = extent
        pool.asleep = True
        held = len(pool.chunks) * pool.chunk_size
        size = pool.chunk_size
        for space in reversed(pool.spaces):
            while space.mapped:
                pool.vm.unmap(space.base + (space.mapped - 1) * size)
                space.mapped -= 1
            _cover(pool, extent, space)
        while pool.chunks:
            pool.vm.free(pool.chunks[-1])
            pool.chunks.pop()
        return held


def _cover(pool: SharedPhysicalPool, extent: _Extent, space: AddressSpace) -> None:
    """Cover what the space had mapped, once nothing is mapped in it."""
    n = extent.mapped.get(space, 0)
    if n and not space.closed and not space.mapped and space not in extent.covered:
        pool.vm.cover(space.base, n * pool.chunk_size)  # type: ignore[attr-defined]
        extent.covered.add(space)


def _uncover(pool: SharedPhysicalPool, extent: _Extent, space: AddressSpace) -> None:
    if space in extent.covered:
        pool.vm.uncover(space.base)  # type: ignore[attr-defined]
        extent.covered.discard(space)


def wake_pool(pool: SharedPhysicalPool) -> int:
    """Create the chunks again and map them where they were; returns the bytes restored.

    A failure (a create or a map the driver refuses) undoes this call's work and is raised:
    the pool is asleep again with exact books. No-op on an awake pool."""
    with pool._lock:
        extent = _asleep.get(pool)
        if extent is None:
            return 0
        if pool.closed:
            raise PoolClosedError("wake: the SharedPhysicalPool was closed while asleep.")
        start = {s: s.mapped for s in extent.mapped}, len(pool.chunks), set(extent.covered)
        try:
            _map_again(pool, extent)
        except BaseException:
            _back_to(pool, extent, *start)
            raise
        del _asleep[pool]
        pool.asleep = False
        return extent.chunks * pool.chunk_size


def _map_again(pool: SharedPhysicalPool, extent: _Extent) -> None:
    while len(pool.chunks) < extent.chunks:
        pool.chunks.append(pool.vm.create(pool.chunk_size))
    for space, mapped in extent.mapped.items():
        _uncover(pool, extent, space)
        while not space.closed and space.mapped < mapped:
            k = space.mapped
            pool.vm.map(space.base + k * pool.chunk_size, pool.chunks[k])
            space.mapped += 1


def _back_to(
    pool: SharedPhysicalPool,
    extent: _Extent,
    mapped: dict[AddressSpace, int],
    chunks: int,
    covered: set[AddressSpace],
) -> None:
    for space in reversed(list(mapped)):
        while space.mapped > mapped[space]:
            pool.vm.unmap(space.base + (space.mapped - 1) * pool.chunk_size)
            space.mapped -= 1
        if space in covered:
            _cover(pool, extent, space)
    while len(pool.chunks) > chunks:
        pool.vm.free(pool.chunks[-1])
        pool.chunks.pop()


def is_asleep(pool: SharedPhysicalPool) -> bool:
    return pool in _asleep
