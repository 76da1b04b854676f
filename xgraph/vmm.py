"""CheckedVirtualMemory: the VirtualMemory contract checked and booked once, for every backend.

Drivers differ in what they verify (aclrt maps only whole handles and unmaps by address,
cuMem needs the size back, mmap silently replaces overlapping mappings). This base class
refuses every contract violation with the same VirtualMemoryError before a driver is
called, keeps the books (reservations, mappings, live chunks), and leaves subclasses the
driver calls declared in `xgraph.interfaces.VirtualMemory` (granularity and six calls).
"""

from __future__ import annotations

import threading

from .errors import VirtualMemoryError
from .interfaces import Backend, PhysicalChunk, VirtualMemory
from .intervals import Intervals


class CheckedVirtualMemory(VirtualMemory):
    """Implements the public contract over the driver calls (`_granularity` ... `_unmap_chunk`).

    Subclasses set up their runtime, then call `super().__init__(backend)`, which asks the
    driver for its granularity once.
    """

    def __init__(self, backend: Backend | None) -> None:
        super().__init__(backend)
        self.granularity = int(self._granularity())
        if self.granularity <= 0:
            raise VirtualMemoryError("granularity", f"the driver reported {self.granularity}")
        self._lock = threading.RLock()
        self._reservations: Intervals[None] = Intervals()
        self._mappings: Intervals[PhysicalChunk] = Intervals()  # each mapping's chunk
        self._chunks: dict[int, tuple[PhysicalChunk, set[int]]] = {}  # id -> (chunk, addresses)

    def _quiesce(self) -> None:
        """Wait for queued device work before memory goes away: unmapping what a queued
        kernel still reads is an illegal access that poisons the whole CUDA context."""
        if self.backend is not None:
            self.backend.synchronize()

    # -- checks ----------------------------------------------------------------------------

    def _check_size(self, call: str, size: int) -> None:
        if size <= 0 or size % self.granularity:
            raise VirtualMemoryError(
                call,
                f"size {size} is not a positive multiple of the granularity {self.granularity}",
                "Round sizes up to VirtualMemory.granularity.",
            )

    def _live(self, call: str, chunk: PhysicalChunk) -> set[int]:
        entry = self._chunks.get(id(chunk))
        if entry is None or entry[0] is not chunk:
            raise VirtualMemoryError(call, "chunk was not created here or is already freed")
        return entry[1]

    # -- contract --------------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        size = int(size)
        self._check_size("reserve", size)
        with self._lock:
            address = int(self._reserve_range(size))
            self._reservations.add(address, size, None)
        return address

    def release(self, address: int) -> None:
        address = int(address)
        with self._lock:
            entry = self._reservations.get(address)
            if entry is None:
                raise VirtualMemoryError("release", f"{address:#x} is not a reservation's start")
            size = entry[0]
            inside = self._mappings.starts_within(address, address + size)
            if inside:
                raise VirtualMemoryError(
                    "release",
                    f"{len(inside)} chunk(s) still mapped in the range",
                    "unmap() every mapping before release().",
                )
            self._release_range(address, size)
            self._reservations.pop(address)

    def create(self, size: int) -> PhysicalChunk:
        size = int(size)
        self._check_size("create", size)
        with self._lock:
            chunk = PhysicalChunk(self._create_chunk(size), size)
            self._chunks[id(chunk)] = (chunk, set())
        return chunk

    def free(self, chunk: PhysicalChunk) -> None:
        with self._lock:
            mapped_at = self._live("free", chunk)
            self._quiesce()
            if mapped_at:
                raise VirtualMemoryError(
                    "free",
                    f"chunk still mapped at {len(mapped_at)} address(es)",
                    "unmap() it everywhere first.",
                )
            self._free_chunk(chunk.handle, chunk.size)
            del self._chunks[id(chunk)]

    def map(self, address: int, chunk: PhysicalChunk) -> None:
        address = int(address)
        with self._lock:
            mapped_at = self._live("map", chunk)
            if address % self.granularity:
                raise VirtualMemoryError(
                    "map", f"address {address:#x} is not aligned to {self.granularity}"
                )
            end = address + chunk.size
            if not self._reservations.holds(address, end):
                raise VirtualMemoryError(
                    "map",
                    f"[{address:#x}, {end:#x}) is not inside a reservation",
                    "Map only inside ranges returned by reserve().",
                )
            other = self._mappings.overlapping(address, end)
            if other is not None:
                raise VirtualMemoryError(
                    "map",
                    f"[{address:#x}, +{chunk.size}) overlaps the mapping at {other:#x}",
                    "unmap() it first.",
                )
            self._map_chunk(address, chunk.handle, chunk.size)
            self._mappings.add(address, chunk.size, chunk)
            mapped_at.add(address)

    def unmap(self, address: int) -> None:
        address = int(address)
        with self._lock:
            entry = self._mappings.get(address)
            if entry is None:
                raise VirtualMemoryError("unmap", f"nothing is mapped at {address:#x}")
            chunk = entry[1]
            self._quiesce()
            self._unmap_chunk(address, chunk.size)
            self._mappings.pop(address)
            self._chunks[id(chunk)][1].discard(address)

    # -- reporting -------------------------------------------------------------------------

    def physical_bytes(self) -> int:
        """Bytes of physical memory in live chunks (what aliases share), by the books."""
        with self._lock:
            return sum(c.size for c, _ in self._chunks.values())

    def live(self) -> dict[str, int]:
        """Counts of live reservations, mappings and chunks (leak checks)."""
        with self._lock:
            return {
                "reservations": len(self._reservations),
                "mappings": len(self._mappings),
                "chunks": len(self._chunks),
            }
