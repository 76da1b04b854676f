"""RestorableSegments: device memory whose physical chunks can be given back and made again
at the same addresses, over any backend's VirtualMemory.

Each segment is one reservation with one physical chunk mapped at its start. `release`
copies the segments asked for into host memory (pinned where the platform has it), then
unmaps and frees every chunk and keeps every reservation, covered by the VirtualMemory's
scratch chunk (`CheckedVirtualMemory.cover`): tensors and graphs that point into a segment
keep their addresses, and a tensor touched while asleep reads and writes the scratch
instead of faulting. `restore` uncovers each segment, creates and maps a chunk again at its
address, copies the saved bytes back and zeroes the rest (a dropped segment comes back as
torch.zeros would make it).

Failures keep the books exact: every driver call is booked as it succeeds. A `release` that
fails is finished by calling it again; a `restore` that fails undoes what it did (the
segments it mapped are unmapped and covered again, the chunks it created freed) and leaves
the set asleep,
saved copies kept, so a later `restore` starts from the same state. Host copies are
dropped only by `commit` (a restore commits unless told not to: `xgraph.wake` commits once
every stage of a wake has succeeded, so a later stage's failure can still go back to sleep).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import AsleepError
from .interfaces import Backend, PhysicalChunk, VirtualMemory


@dataclass(eq=False)
class Segment:
    """One reservation and the chunk mapped at its start (None while given back)."""

    address: int
    size: int
    chunk: PhysicalChunk | None = None
    mapped: bool = False
    covered: bool = False  # the scratch chunk is mapped over it (while given back)
    saved: torch.Tensor | None = None  # the contents, in host memory, while given back
    retired: bool = False  # given back for good, range covered until its last view goes


def host_buffer(backend: Backend, nbytes: int) -> torch.Tensor:
    """Host memory for `nbytes` of device memory: pinned where the platform has it (fast,
    asynchronous copies), plain on a backend whose device is the host."""
    if backend.device.type != "cpu":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
        except RuntimeError:  # no pinned memory on this platform: pageable still works
            pass
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu")


class RestorableSegments:
    """Segments of one VirtualMemory released and restored together (see module doc)."""

    def __init__(self, backend: Backend, vm: VirtualMemory, what: str) -> None:
        self.backend, self.vm, self.what = backend, vm, what
        self.segments: dict[int, Segment] = {}  # address -> segment
        self.asleep = False
        self._lock = threading.RLock()

    # -- segments --------------------------------------------------------------------------

    def add(self, nbytes: int) -> Segment:
        """A new segment of at least `nbytes`, mapped (refused while asleep)."""
        gran = self.vm.granularity
        size = max(gran, -(-int(nbytes) // gran) * gran)
        with self._lock:
            if self.asleep:
                raise AsleepError(
                    f"{self.what} is asleep: its memory was given back by sleep(); call "
                    "wake() before allocating in it."
                )
            address = self.vm.reserve(size)
            seg = Segment(address, size)
            try:
                seg.chunk = self.vm.create(size)
                self.vm.map(address, seg.chunk)
                seg.mapped = True
            except BaseException:
                self._drop(seg)
                raise
            self.segments[address] = seg
            return seg

    def remove(self, address: int, seg: Segment | None = None) -> None:
        """Give a segment back for good: unmap, free, release (each booked as it succeeds).
        `seg`: only if the address still holds that segment (no-op where it is gone)."""
        with self._lock:
            found = self.segments.get(address)
            if found is None or (seg is not None and found is not seg):
                return
            self._drop(found)
            del self.segments[address]

    def retire(self, address: int) -> None:
        """Give a segment's chunk back for good but keep its range, covered by the scratch
        chunk, until `remove`: views that outlive their owner (a traceback's) then read
        scratch bytes instead of faulting. Never restored."""
        with self._lock:
            seg = self.segments.get(address)
            if seg is not None:
                seg.retired, seg.saved = True, None
                self._give_back(seg)

    def _drop(self, seg: Segment) -> None:
        self._uncover(seg)
        self._unmap_and_free(seg)
        self.vm.release(seg.address)
        seg.saved = None

    def _cover(self, seg: Segment) -> None:
        if not seg.covered and not seg.mapped:
            self.vm.cover(seg.address, seg.size)  # type: ignore[attr-defined]
            seg.covered = True

    def _uncover(self, seg: Segment) -> None:
        if seg.covered:
            self.vm.uncover(seg.address)  # type: ignore[attr-defined]
            seg.covered = False

    def _give_back(self, seg: Segment) -> None:
        """Unmap and free the segment's chunk, then cover its range at once: the window in
        which a touch faults is one segment's, not the whole sleep's."""
        self._unmap_and_free(seg)
        self._cover(seg)

    def _unmap_and_free(self, seg: Segment) -> None:
        if seg.mapped:
            self.vm.unmap(seg.address)
            seg.mapped = False
        if seg.chunk is not None:
            self.vm.free(seg.chunk)
            seg.chunk = None

    # -- sleep and wake --------------------------------------------------------------------

    def release(self, save: Callable[[Segment], bool]) -> tuple[int, int]:
        """Copy the segments `save` picks to host memory, then unmap and free every chunk;
        returns (bytes given back, bytes copied). Idempotent; after a driver failure,
        calling it again finishes the job."""
        with self._lock:
            live = [s for s in self.segments.values() if s.chunk is not None]
            todo = [s for s in live if s.mapped and s.saved is None and save(s)]
            copies = [(s, host_buffer(self.backend, s.size)) for s in todo]
            for s, host in copies:  # nothing is given back until every copy is done
                host.copy_(self.backend.as_tensor(s.address, s.size), non_blocking=True)
            self.backend.synchronize()
            for s, host in copies:
                s.saved = host
            self.asleep = True
            for s in self.segments.values():
                self._give_back(s)
            return sum(s.size for s in live), sum(s.size for s, _ in copies)

    def restore(self, commit: bool = True) -> int:
        """Create and map every chunk again at its address, copy saved bytes back and zero
        the rest; returns the bytes restored. A failure undoes this call's work (asleep
        again, saved copies kept) and is raised. No-op when awake."""
        with self._lock:
            if not self.asleep:
                return 0
            fresh = [s for s in self.segments.values() if not s.mapped and not s.retired]
            was_covered = [s.covered for s in fresh]
            try:
                for s in fresh:
                    if s.chunk is None:
                        s.chunk = self.vm.create(s.size)
                    self._uncover(s)
                    self.vm.map(s.address, s.chunk)
                    s.mapped = True
                for s in fresh:
                    view = self.backend.as_tensor(s.address, s.size)
                    if s.saved is not None:
                        view.copy_(s.saved, non_blocking=True)
                    else:
                        view.zero_()
                self.backend.synchronize()
            except BaseException:
                for s, covered in reversed(list(zip(fresh, was_covered))):
                    self._unmap_and_free(s)  # back to the state this call started from
                    if covered:
                        self._cover(s)
                raise
            self.asleep = False
            if commit:
                self.commit()
            return sum(s.size for s in fresh)

    def undo_restore(self) -> None:
        """Back to sleep after an uncommitted restore (a later stage of a wake failed): the
        saved copies are still held, so nothing is copied."""
        with self._lock:
            if not self.asleep:
                self.release(lambda s: False)

    def commit(self) -> None:
        """Drop the host copies of an awake set (the device holds the bytes again)."""
        with self._lock:
            if not self.asleep:
                for s in self.segments.values():
                    s.saved = None

    # -- reporting -------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of every segment (held now, or to be held again on wake)."""
        return sum(s.size for s in self.segments.values())

    @property
    def resident_bytes(self) -> int:
        """Bytes of the chunks held now, by the books."""
        return sum(s.size for s in self.segments.values() if s.chunk is not None)

    @property
    def saved_bytes(self) -> int:
        return sum(s.size for s in self.segments.values() if s.saved is not None)

    def ranges(self) -> list[tuple[int, int]]:
        """(start, size) of every reservation."""
        return [(s.address, s.size) for s in self.segments.values()]
