"""The CPU backend's native capture pool: a small caching allocator over memfd segments.

It plays the part torch's CUDA caching allocator plays for a graph pool: blocks freed
during a capture are reused by later allocations of that capture (and, when several graphs
share the pool, by later captures), and segments are held until the pool closes. Segments
come from the backend's own VirtualMemory or, in shared-physical mode, from a
SharedPhysicalPool's current address space.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import TYPE_CHECKING

from ...errors import PoolClosedError, XGraphError
from ...interfaces import CapturePool, PhysicalChunk, SegmentAllocator
from .placement import PlaceInPool

if TYPE_CHECKING:
    from .vmm import HostVirtualMemory

BLOCK_ROUND = 512  # like torch's kMinBlockSize: every block 512-byte aligned


class _OwnSegments:
    """Segments of a private or shared native pool: reserve + create + map, one chunk each."""

    def __init__(self, vm: HostVirtualMemory) -> None:
        self.vm = vm
        self._held: dict[int, PhysicalChunk] = {}

    def alloc(self, nbytes: int) -> int:
        """A mapped segment; a driver call that fails gives back what the others took."""
        address = self.vm.reserve(nbytes)
        try:
            chunk = self.vm.create(nbytes)
            try:
                self.vm.map(address, chunk)
            except BaseException:
                self.vm.free(chunk)
                raise
        except BaseException:
            self.vm.release(address)
            raise
        self._held[address] = chunk
        return address

    def free(self, address: int, nbytes: int) -> None:
        chunk = self._held.pop(address)
        self.vm.unmap(address)
        self.vm.free(chunk)
        self.vm.release(address)


class HostCachingPool(CapturePool):
    """Best-fit block allocator over segments; blocks never cross a segment boundary."""

    def __init__(self, vm: HostVirtualMemory, segments: SegmentAllocator | None = None) -> None:
        super().__init__(segments)
        self.vm = vm
        self.granularity = vm.granularity
        self._source: SegmentAllocator = segments if segments is not None else _OwnSegments(vm)
        self._lock = threading.Lock()
        self._segs: list[tuple[int, int]] = []  # sorted (start, size)
        self._free: list[tuple[int, int]] = []  # sorted (size, address) for best fit
        self._free_at: dict[int, int] = {}  # address -> size of free blocks
        self._free_end: dict[int, int] = {}  # end address -> address of free blocks
        self._used: dict[int, int] = {}  # address -> size of live blocks
        # frees arrive from tensor finalizers, possibly in the middle of alloc (cyclic GC):
        # queue them and apply them under the lock
        self._pending: collections.deque[int] = collections.deque()

    @property
    def closed(self) -> bool:  # type: ignore[override]
        """Closed, or its segments' address space is gone (a closed SharedPhysicalPool): a
        graph on it then refuses to replay (PoolClosedError) instead of touching unmapped
        memory."""
        return self._closed or bool(getattr(self._source, "closed", False))

    @closed.setter
    def closed(self, value: bool) -> None:
        self._closed = value

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()

    def allocating(self) -> PlaceInPool | None:
        """Host tensors made in the block come from this pool (memory regions)."""
        return None if self.segments is None else PlaceInPool(self)

    # -- allocation ------------------------------------------------------------------------

    def _segment_of(self, address: int) -> tuple[int, int]:
        i = bisect.bisect_right(self._segs, (address, float("inf"))) - 1
        return self._segs[i]

    def owns(self, address: int) -> bool:
        """Whether `address` lies inside one of this pool's segments."""
        i = bisect.bisect_right(self._segs, (address, float("inf"))) - 1
        return i >= 0 and address < self._segs[i][0] + self._segs[i][1]

    def alloc(self, nbytes: int) -> int:
        size = max(BLOCK_ROUND, -(-nbytes // BLOCK_ROUND) * BLOCK_ROUND)
        with self._lock:
            if self.closed:
                raise PoolClosedError("This capture pool is closed; create a new one.")
            self._drain()
            i = bisect.bisect_left(self._free, (size, 0))
            if i < len(self._free):
                bsize, addr = self._free[i]
                self._remove_free(addr)
            else:
                seg = -(-size // self.granularity) * self.granularity
                addr = self._source.alloc(seg)
                if not addr:
                    raise XGraphError(
                        f"Out of memory: the pool's segment allocator could not supply {seg} bytes."
                    )
                bisect.insort(self._segs, (addr, seg))
                bsize = seg
            if bsize - size >= BLOCK_ROUND:  # split; the tail stays free
                self._insert_free(addr + size, bsize - size)
                bsize = size
            self._used[addr] = bsize
            return addr

    def _insert_free(self, addr: int, size: int) -> None:
        self._free_at[addr] = size
        self._free_end[addr + size] = addr
        bisect.insort(self._free, (size, addr))

    def _remove_free(self, addr: int) -> int:
        size = self._free_at.pop(addr)
        del self._free_end[addr + size]
        self._free.pop(bisect.bisect_left(self._free, (size, addr)))
        return size

    def free(self, address: int) -> None:
        """Return a block (safe to call from a finalizer at any time)."""
        self._pending.append(address)

    def _drain(self) -> None:
        while self._pending:
            self._free_now(self._pending.popleft())

    def _free_now(self, address: int) -> None:
        size = self._used.pop(address)
        seg_start, seg_size = self._segment_of(address)
        end = address + size
        # coalesce with free neighbours inside the same segment
        if end < seg_start + seg_size and end in self._free_at:
            size += self._remove_free(end)
        prev = self._free_end.get(address)
        if prev is not None and prev >= seg_start:
            size += self._remove_free(prev)
            address = prev
        self._insert_free(address, size)

    # -- contract --------------------------------------------------------------------------

    def reserved_bytes(self) -> int:
        return sum(s for _, s in self._segs)

    def live_blocks(self) -> int:
        """Blocks handed out and not freed yet (a pool with none can give its segments back)."""
        with self._lock:
            self._drain()
            return len(self._used)

    def _release(self) -> None:
        with self._lock:
            segs, self._segs = self._segs, []
            self._free.clear()
            self._free_at.clear()
            self._free_end.clear()
            self._used.clear()
            self._pending.clear()
        for addr, size in segs:
            self._source.free(addr, size)
