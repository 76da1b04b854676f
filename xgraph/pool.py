"""SharedPhysicalPool: every capture in its own address range over one list of physical chunks.

Each capture gets a fresh VA space and bump-allocates its segments from offset 0. Chunk k
of the shared list backs bytes [k*chunk, (k+1)*chunk) of *every* space, so two captures
that both used their first N MiB share the same N MiB of physical memory. The list grows
only when a capture's cursor passes the high-water mark. Nothing is freed before close():
a captured graph keeps reading and writing its addresses at every replay. This is safe
because graphs never replay concurrently and each step's outputs are copied out of the
pool (into persistent buffers) inside the capture.

Physical bytes = max over captures (rounded to chunks), whatever the capture order;
virtual bytes grow with the number of captures. Each capture reserves as much address space
as it could ever use, `Backend.capture_space_bytes()` (the device's memory): its cursor
never passes the physical chunks behind it.

The pool knows the GraphMemory objects over it and refuses to close while one is open
(MemoryInUseError naming their executors): close the executors and memories first.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from .errors import AsleepError, MemoryInUseError, PoolClosedError, XGraphError
from .interfaces import FALLBACK_CAPTURE_SPACE_BYTES, PhysicalChunk, VirtualMemory
from .steplock import StepLock

logger = logging.getLogger("xgraph")


@dataclass(eq=False)
class AddressSpace:
    """One capture's VA range; the segment allocator a native capture pool draws from."""

    pool: SharedPhysicalPool
    base: int
    size: int
    cursor: int = 0  # bump pointer (bytes from base)
    mapped: int = 0  # chunks [0, mapped) are mapped at base + k * chunk
    created: list[int] = field(default_factory=list)  # indices of chunks this space created
    closed: bool = False
    failure: XGraphError | None = None  # why the last allocation returned 0

    def alloc(self, nbytes: int) -> int:
        """Bump-allocate a segment; returns 0 when the pool cannot supply it (OOM)."""
        try:
            return self.pool.grow(self, nbytes)
        except XGraphError as exc:  # allocator callbacks must not raise into the runtime
            # the text, not the exception: a kept log record would keep its frames' tensors
            logger.error(
                "shared-physical pool: allocation of %d bytes failed: %s", nbytes, str(exc)
            )
            self.failure = exc  # the executor reports it instead of the runtime's bare OOM
            return 0

    def free(self, address: int, nbytes: int) -> None:
        """Segments are never returned before close(): graphs keep using their addresses."""


class SharedPhysicalPool:
    """Physical memory shared by all captures; one VA space per capture (see module doc)."""

    def __init__(
        self,
        vm: VirtualMemory,
        chunk_size: int | None = None,
        space_bytes: int | None = None,
    ) -> None:
        """`space_bytes`: address space per capture; default `capture_space_bytes()` of the
        VirtualMemory's backend."""
        gran = vm.granularity
        chunk = chunk_size or gran
        if chunk % gran:
            raise XGraphError(
                f"chunk_size {chunk} is not a multiple of the VMM granularity {gran}."
            )
        if space_bytes is None:
            backend = getattr(vm, "backend", None)  # a VirtualMemory made without one: none
            space_bytes = FALLBACK_CAPTURE_SPACE_BYTES
            if backend is not None:
                space_bytes = backend.capture_space_bytes()
        self.vm = vm
        self.chunk_size = chunk
        self.space_bytes = -(-space_bytes // chunk) * chunk
        self.steps = StepLock()  # every step over this physical memory, whichever executor
        self._users: weakref.WeakSet[Any] = weakref.WeakSet()  # the open GraphMemory objects
        self._lock = threading.RLock()
        self.chunks: list[PhysicalChunk] = []
        self.spaces: list[AddressSpace] = []
        self.high_water = 0  # bytes: the largest cursor any space reached
        self.map_calls = 0
        self.closed = False
        self.asleep = False  # its chunks were given back (xgraph.pool_sleep) until wake

    # -- users ---------------------------------------------------------------------------

    def attach(self, memory: Any) -> None:
        """Count `memory` (a GraphMemory) among the pool's users until it detaches."""
        with self._lock:
            if self.closed:
                raise PoolClosedError("SharedPhysicalPool is closed; create a new one.")
            self._users.add(memory)

    def detach(self, memory: Any) -> None:
        with self._lock:
            self._users.discard(memory)

    def memories(self) -> list[Any]:
        """The open GraphMemory objects over this pool."""
        with self._lock:
            return list(self._users)

    def _refuse_in_use(self) -> None:
        users = list(self._users)
        if not users:
            return
        names = [repr(n) for m in users for n in m.users()]
        who = f"the open executor(s) {', '.join(names)}" if names else "an open GraphMemory"
        raise MemoryInUseError(
            f"SharedPhysicalPool.close(): {who} still use this pool, and their graphs would "
            "replay memory that is gone. Close them first (executor.close(), then "
            "GraphMemory.close() for a memory you made), then the pool."
        )

    # -- spaces ----------------------------------------------------------------------------

    def new_space(self) -> AddressSpace:
        """A fresh VA range for the next capture (nothing mapped until it allocates)."""
        with self._lock:
            if self.closed:
                raise PoolClosedError("SharedPhysicalPool is closed; create a new one.")
            base = self.vm.reserve(self.space_bytes)
            space = AddressSpace(self, base, self.space_bytes)
            self.spaces.append(space)
            return space

    def grow(self, space: AddressSpace, nbytes: int) -> int:
        """Give `space` the next `nbytes` (rounded to chunks), mapping and creating chunks."""
        with self._lock:
            if self.closed or space.closed:
                raise PoolClosedError("allocation from a closed pool or space")
            if self.asleep:
                raise AsleepError("the graph memory is asleep (sleep()); call wake() first.")
            size = -(-nbytes // self.chunk_size) * self.chunk_size
            start = space.cursor
            end = start + size
            if end > space.size:
                raise XGraphError(
                    f"capture needs more than {space.size} bytes of address space; raise "
                    "SharedPhysicalPool(space_bytes=...)."
                )
            need = end // self.chunk_size
            while space.mapped < need:
                k = space.mapped
                if k == len(self.chunks):  # past the high-water mark: physical grows
                    self.chunks.append(self.vm.create(self.chunk_size))
                    space.created.append(k)
                self.vm.map(space.base + k * self.chunk_size, self.chunks[k])
                self.map_calls += 1
                space.mapped += 1
            space.cursor = end
            self.high_water = max(self.high_water, end)
            return space.base + start

    def _unmap_space(self, space: AddressSpace) -> None:
        # last mapping first, each step booked as it succeeds: a driver failure leaves
        # exact books, and calling again continues where it stopped
        while space.mapped:
            self.vm.unmap(space.base + (space.mapped - 1) * self.chunk_size)
            space.mapped -= 1
        self.vm.release(space.base)
        space.closed = True

    def discard(self, space: AddressSpace) -> None:
        """Roll back a failed capture: unmap and release its range, free the chunks it made.

        Only the newest space can have created chunks past every other space's extent, so
        the pool returns exactly to its state before `new_space`.
        """
        with self._lock:
            if space.closed:
                return
            if space is not self.spaces[-1]:
                raise XGraphError("discard() rolls back the newest space only.")
            self._unmap_space(space)
            self.spaces.pop()
            for k in sorted(space.created, reverse=True):
                if k != len(self.chunks) - 1:
                    raise XGraphError("chunk list changed under a space being discarded")
                self.vm.free(self.chunks[-1])
                self.chunks.pop()
            self.high_water = max((s.cursor for s in self.spaces), default=0)

    # -- accounting ------------------------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        return len(self.chunks) * self.chunk_size

    @property
    def virtual_bytes(self) -> int:
        return sum(s.size for s in self.spaces if not s.closed)

    @property
    def mapped_bytes(self) -> int:
        return sum(s.mapped for s in self.spaces if not s.closed) * self.chunk_size

    def stats(self) -> dict[str, int]:
        return {
            "physical_bytes": self.physical_bytes,
            "virtual_bytes": self.virtual_bytes,
            "mapped_bytes": self.mapped_bytes,
            "high_water_bytes": self.high_water,
            "spaces": len(self.spaces),
            "chunks": len(self.chunks),
            "chunk_size": self.chunk_size,
            "map_calls": self.map_calls,
        }

    def close(self) -> None:
        """Unmap every space, release every range, free every chunk. Graphs go first.

        Refused (MemoryInUseError) while a GraphMemory over it is open. Idempotent, and
        after a driver failure calling it again finishes the job.
        """
        with self._lock:
            self._refuse_in_use()
            self.closed = True  # no new space or allocation from here on
            while self.spaces:
                if not self.spaces[-1].closed:
                    self._unmap_space(self.spaces[-1])
                self.spaces.pop()
            while self.chunks:
                self.vm.free(self.chunks[-1])
                self.chunks.pop()
            self.high_water = 0

    def __enter__(self) -> SharedPhysicalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
