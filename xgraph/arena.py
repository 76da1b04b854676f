"""Arena: an executor's persistent input buffers in memory that sleep gives back and wake
restores at the same addresses.

The packed input buffer (token ids, positions, attention metadata: a few KB to MB) is a
segment of its own, one reservation and one chunk (`RestorableSegments`), seen as a device
tensor through `Backend.as_tensor`, so the graphs that read it keep their addresses across a
sleep; its contents are copied to host memory and back, so nothing needs staging again after
wake. While asleep the segment is covered by the scratch chunk of its VirtualMemory (a view
of a buffer touched then reads and writes that instead of faulting). The segments live on a
VirtualMemory of their own (a second instance of the backend's class), so the graph memory's
books (and faults injected into them) stay the graph memory's.

The output buffers stay in torch's allocator: a caller may hold views of the last outputs
past a step, a close, or an exception's traceback, so their memory must go with the last
view, which a driver allocation that sleep unmaps cannot promise.

The input buffers go when their executor closes: `close()` closes its planner first (planning,
staging or reading its buffers then raises XGraphError instead of touching memory that is
gone; the planner, its staging and the runners drop their views), resets the graphs, then
gives every segment's chunk back. A segment whose buffer someone still views (a traceback
holding a forward's arguments, a caller's own reference) keeps its range, covered by the
scratch chunk of the VirtualMemory, until that last view goes: reading it past the close
reads scratch bytes instead of faulting. An executor collected without close() leaves each
buffer to its last tensor (a finalizer on the storage), so a planner someone still holds
keeps its buffer mapped. A finalizer may fire on any thread at any point (cyclic garbage
collection): inside a call of the arena's VirtualMemory or segments on that thread, while a
capture of xgraph's is open on any thread, or while one is open on that thread's stream.
Giving memory back is not safe there: the segment then goes at the next safe point (a later
finalizer's, the arena's next operation, the next arena made). A capture that is not
xgraph's, open on another thread, is not seen: an engine that captures graphs of its own on
one thread drops xgraph's buffers on that thread, or outside those captures.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import torch

from .errors import XGraphError
from .graphs import recording_anywhere
from .interfaces import Backend, VirtualMemory
from .restorable import RestorableSegments, Segment

logger = logging.getLogger("xgraph")

# arenas with deferred releases, held strongly: an executor's arena is often otherwise gone
# by the time its buffers die, and its segments must still be given back
_pending: set[Arena] = set()
_vms: weakref.WeakKeyDictionary[Backend, VirtualMemory] = weakref.WeakKeyDictionary()
_vms_lock = threading.Lock()


class Arena:
    """Persistent buffers of one executor (see the module docstring)."""

    def __init__(self, backend: Backend, vm: VirtualMemory, name: str) -> None:
        self.backend, self.vm = backend, vm
        self.segments = RestorableSegments(backend, vm, f"{name}: persistent buffers")
        self._dead: list[Segment] = []
        self._alive: dict[int, weakref.finalize] = {}  # address -> its buffer's finalizer
        self._lock = threading.Lock()
        self.closed = False
        drain_pending()

    @classmethod
    def of(cls, backend: Backend, name: str) -> Arena | None:
        """An arena over the backend's buffer memory (None without virtual memory)."""
        vm = buffer_memory(backend)
        return None if vm is None else cls(backend, vm, name)

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 device tensor of `nbytes` in a segment of its own, kept across a sleep."""
        if self.closed:
            raise XGraphError(
                f"{self.segments.what}: the executor is closed; create a new executor."
            )
        self.drain()
        seg = self.segments.add(max(int(nbytes), 1))
        t = self.backend.as_tensor(seg.address, seg.size)
        done = weakref.finalize(t.untyped_storage(), self._died, seg)
        done.atexit = False  # at exit the memory outlives Python's objects
        self._alive[seg.address] = done
        return t[:nbytes]

    def _died(self, seg: Segment) -> None:
        with self._lock:
            self._dead.append(seg)
            self._alive.pop(seg.address, None)
        _pending.add(self)  # given back now where safe, else at the next safe point
        drain_pending()

    def safe_here(self) -> bool:
        """Whether this thread may give this arena's memory back now (see the module doc):
        no capture of xgraph's open on any thread nor on this thread's stream, no call of its
        VirtualMemory or segments under way on this thread."""
        try:
            if recording_anywhere() or self.backend.stream_capturing():
                return False
        except Exception:  # a context that cannot answer: an explicit operation will
            return False
        return not (_held_here(self.vm) or _held_here(self.segments))

    def drain(self) -> None:
        """Give back the segments of buffers that are gone."""
        while True:
            with self._lock:
                if not self._dead:
                    _pending.discard(self)
                    return
                seg = self._dead.pop()  # claimed: a drain on another thread takes the next
            try:
                self.segments.remove(seg.address, seg)  # a no-op where it went already
            except Exception:  # from a finalizer: report, keep it for the next attempt
                logger.exception("releasing a persistent buffer's memory failed")
                with self._lock:
                    self._dead.append(seg)
                _pending.add(self)
                return

    def close(self) -> None:
        """Give every buffer's memory back now: its executor closed, and closed its planner,
        so nothing of xgraph writes or reads the buffers again (idempotent; after a driver
        failure, calling it again finishes the job)."""
        self.closed = True
        # one C-level copy: a finalizer elsewhere cannot change the dict while it is read
        # (taking self._lock here could deadlock with a finalizer run by this copy's GC)
        watched = list(self._alive.values())
        if any(done.alive for done in watched):
            gc.collect()  # a caught exception's frames, cyclic garbage, often hold the last views
        self.drain()
        for address in list(self.segments.segments):
            done = self._alive.get(address)
            if done is not None and done.alive:
                self.segments.retire(address)  # a view still held: covered until it goes
            else:
                self.segments.remove(address)
        self.drain()  # a view dropped inside the loop above (its finalizer deferred there)

    # -- sleep and wake --------------------------------------------------------------------

    def sleep(self) -> tuple[int, int]:
        """Copy every buffer to host memory, then give its memory back; returns (bytes given
        back, bytes copied)."""
        self.drain()
        return self.segments.release(lambda s: True)

    def wake(self, commit: bool = True) -> int:
        self.drain()
        return self.segments.restore(commit)

    @property
    def asleep(self) -> bool:
        return self.segments.asleep


def drain_pending() -> None:
    """Give back the segments whose release was deferred (a finalizer at an unsafe point),
    of every arena for which this thread is at a safe point now."""
    for arena in list(_pending):
        if arena.safe_here():
            arena.drain()


def _held_here(obj: object) -> bool:
    """Whether this thread is inside a call that holds `obj`'s lock (also where the lock
    cannot say: then no release is safe)."""
    owned = getattr(getattr(obj, "_lock", None), "_is_owned", None)
    return owned is None or owned()


def buffer_memory(backend: Backend) -> VirtualMemory | None:
    """The VirtualMemory persistent buffers live on: a second instance of the backend's class,
    made once per backend; None where the backend has no virtual memory."""
    vm = backend.virtual_memory()
    if vm is None:
        return None
    with _vms_lock:
        own = _vms.get(backend)
        if own is None:
            own = _vms[backend] = type(vm)(backend)  # type: ignore[call-arg]
        return own
