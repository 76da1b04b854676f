"""CheckedVirtualMemory: the VirtualMemory contract checked and booked once, for every backend.

Drivers differ in what they verify (aclrt maps only whole handles and unmaps by address,
cuMem needs the size back, mmap silently replaces overlapping mappings). This base class
refuses every contract violation with the same VirtualMemoryError before a driver is
called, keeps the books (reservations, mappings, live chunks, covers), and leaves
subclasses the driver calls declared in `xgraph.interfaces.VirtualMemory` (granularity and
six calls).

Covers are what sleep leaves behind a range it gave back: one scratch chunk of
`scratch_bytes` (one granule unless a driver says otherwise), made with the first cover,
zeroed, mapped at every granule of every covered range and freed with the last cover. A
tensor of a sleeping range then reads the scratch's bytes and writes into it instead of
faulting (SIGSEGV on the host; an illegal address, which ends the CUDA context, on a GPU).
Two optional driver calls do the work, `_map_scratch` and `_unmap_scratch`: by default one
`_map_chunk` / `_unmap_chunk` per granule; a driver batches where its API allows.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .errors import VirtualMemoryError
from .interfaces import Backend, PhysicalChunk, VirtualMemory
from .intervals import Intervals

logger = logging.getLogger("xgraph")


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
        self._covers: Intervals[None] = Intervals()  # ranges backed by the scratch chunk
        self._scratch: PhysicalChunk | None = None  # live while any range is covered

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

    def _check_range(self, call: str, address: int, end: int) -> None:
        if address % self.granularity:
            raise VirtualMemoryError(
                call, f"address {address:#x} is not aligned to {self.granularity}"
            )
        if not self._reservations.holds(address, end):
            raise VirtualMemoryError(
                call,
                f"[{address:#x}, {end:#x}) is not inside a reservation",
                "Map only inside ranges returned by reserve().",
            )

    def _refuse_overlap(self, call: str, address: int, end: int) -> None:
        other = self._mappings.overlapping(address, end)
        if other is not None:
            raise VirtualMemoryError(
                call,
                f"[{address:#x}, {end:#x}) overlaps the mapping at {other:#x}",
                "unmap() it first.",
            )
        covered = self._covers.overlapping(address, end)
        if covered is not None:
            raise VirtualMemoryError(
                call,
                f"[{address:#x}, {end:#x}) overlaps the sleeping range at {covered:#x}, "
                "covered by the scratch chunk",
                "uncover() it first.",
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
            for start in self._covers.starts_within(address, address + size):
                self.uncover(start)  # a reservation takes its covers with it
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
            end = address + chunk.size
            self._check_range("map", address, end)
            self._refuse_overlap("map", address, end)
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

    # -- covers (sleep; see the module doc) --------------------------------------------------

    @property
    def scratch_bytes(self) -> int:
        """Size of the scratch chunk: one granule (a driver that can map part of a chunk may
        take more, so that it maps fewer pieces)."""
        return self.granularity

    def cover(self, address: int, size: int) -> None:
        """Back [address, +size), inside one reservation with nothing mapped in it, with the
        scratch chunk mapped at every granule: reads see the scratch, writes land in it."""
        address, size = int(address), int(size)
        self._check_size("cover", size)
        with self._lock:
            self._check_range("cover", address, address + size)
            self._refuse_overlap("cover", address, address + size)
            scratch, made = self._scratch, self._scratch is None
            if scratch is None:
                n = self.scratch_bytes
                scratch = self._scratch = PhysicalChunk(self._create_chunk(n), n)
            try:
                self._map_scratch(address, size, scratch.handle)
            except BaseException:
                self._undo(self._drop_unused_scratch)
                raise
            self._covers.add(address, size, None)
            if made:  # what a slept tensor reads first: zeros, not a freed chunk's old bytes
                try:
                    self._zero_scratch(address, min(size, scratch.size))
                except BaseException:
                    self._undo(lambda: self.uncover(address))
                    raise

    def uncover(self, address: int) -> None:
        """Unmap the scratch chunk from the range `cover` backed at `address`; the scratch is
        freed with the last cover."""
        address = int(address)
        with self._lock:
            entry = self._covers.get(address)
            if entry is None:
                raise VirtualMemoryError("uncover", f"no covered range starts at {address:#x}")
            self._quiesce()  # queued work may still read or write the scratch there
            self._unmap_scratch(address, entry[0])
            self._covers.pop(address)
            self._drop_unused_scratch()

    def _drop_unused_scratch(self) -> None:
        if self._scratch is not None and not self._covers:
            self._free_chunk(self._scratch.handle, self._scratch.size)
            self._scratch = None

    def _pieces(self, address: int, size: int) -> list[tuple[int, int]]:
        """(address, size) of each map of the scratch over [address, +size)."""
        step, end = self.scratch_bytes, address + size
        return [(a, min(step, end - a)) for a in range(address, end, step)]

    def _map_scratch(self, address: int, size: int, handle: Any) -> None:
        """Driver: map the scratch `handle` at every piece of [address, +size), all or nothing
        (a failure unmaps what this call mapped, then raises). Default: one `_map_chunk` per
        piece, a whole handle each where `scratch_bytes` is the granularity."""
        done = 0
        try:
            for a, n in self._pieces(address, size):
                self._map_chunk(a, handle, n)
                done += n
        except BaseException:
            if done:
                self._undo(lambda: self._unmap_scratch(address, done))
            raise

    def _unmap_scratch(self, address: int, size: int) -> None:
        """Driver: unmap the scratch from every piece of [address, +size), all or nothing (a
        failure maps back what this call unmapped). Default: one `_unmap_chunk` per piece,
        from the top."""
        end = address + size
        try:
            for a, n in reversed(self._pieces(address, size)):
                self._unmap_chunk(a, n)
                end = a
        except BaseException:
            if end < address + size:
                handle = self._scratch.handle if self._scratch is not None else None
                self._undo(lambda: self._map_scratch(end, address + size - end, handle))
            raise

    def _zero_scratch(self, address: int, size: int) -> None:
        """Zero the new scratch chunk, mapped at [address, +size), through the backend."""
        if self.backend is not None:
            self.backend.as_tensor(address, size).zero_()
            self.backend.synchronize()

    @staticmethod
    def _undo(step: Any) -> None:
        """Run an undo step of a failed driver call; its own failure is logged, not raised
        (the call's failure is the one the caller must see)."""
        try:
            step()
        except Exception:
            logger.exception("undoing a failed scratch-chunk driver call failed")

    # -- reporting -------------------------------------------------------------------------

    def physical_bytes(self) -> int:
        """Bytes of physical memory in live chunks (what aliases share), the scratch chunk
        among them, by the books."""
        with self._lock:
            scratch = self._scratch.size if self._scratch is not None else 0
            return scratch + sum(c.size for c, _ in self._chunks.values())

    def mapped_bytes(self) -> int:
        """Bytes of address space with a chunk mapped, by the books."""
        with self._lock:
            return sum(n for _, n, _ in self._mappings.items())

    def covered_bytes(self) -> int:
        """Bytes of address space the scratch chunk covers (sleeping ranges), by the books."""
        with self._lock:
            return sum(n for _, n, _ in self._covers.items())

    def live(self) -> dict[str, int]:
        """Counts of live reservations, mappings and chunks (leak checks); a covered range
        counts as one mapping, the scratch chunk as one chunk."""
        with self._lock:
            return {
                "reservations": len(self._reservations),
                "mappings": len(self._mappings) + len(self._covers),
                "chunks": len(self._chunks) + (self._scratch is not None),
            }

    def scratch_held(self) -> int:
        """Bytes of the scratch chunk held now (0 while nothing is covered)."""
        with self._lock:
            return self._scratch.size if self._scratch is not None else 0

    def covers(self) -> int:
        """How many ranges the scratch chunk covers now."""
        with self._lock:
            return len(self._covers)
