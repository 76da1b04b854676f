"""What an executor holds beyond Python objects, and how it is given back: on close(), when
the executor is garbage-collected, or at interpreter exit.

An executor's graphs, native capture pools, address ranges and physical chunks are not
freed by reference counting: the VirtualMemory keeps books of them, and a device keeps them
until they are released. `Holdings` keeps them apart from the executor object, so a
`weakref.finalize` on the executor can release them once it is dropped without close(),
and, at interpreter exit, before teardown destroys pools and tensors in whatever order it
likes. An owner of an executor (a model wrapper) gets the same by holding it: when the owner
goes, so does the executor, and its holdings are released.

The order is always the same: leave the graph memory's list of users, wait for the work
queued on the device, reset every graph, give back the persistent input buffers (on close;
collected, each goes with its last tensor), then close the graph memory if the executor
owns it. A finalizer never raises: a failure is logged, and what the driver refused stays
booked.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

from .arena import Arena
from .interfaces import Backend
from .memory import GraphMemory, Lease
from .options import Kind

logger = logging.getLogger("xgraph")


class Recording(Protocol):
    """A captured forward (FullGraph or PiecewiseGraph) as the executor caches it; the
    capture transaction (xgraph.capture) begins, ends or aborts it, the key cache replays."""

    context: object

    def begin(self) -> None: ...
    def end(self) -> None: ...
    def abort(self) -> None: ...
    def replay(self) -> None: ...
    def reset(self) -> None: ...
    def describe(self) -> list[str]: ...


@dataclass
class Entry:
    """One cached graph of an executor: its kind, recording and lease, and its hits."""

    kind: Kind
    graph: Recording
    lease: Lease
    capture_seconds: float
    hits: int = 0


class Holdings:
    """An executor's graphs and graph memory, releasable without the executor object."""

    def __init__(self, name: str, backend: Backend, memory: GraphMemory, owns_memory: bool):
        self.name = name
        self.backend = backend
        self.memory = memory
        self.owns_memory = owns_memory
        self.graphs: dict[tuple, Entry] = {}  # each key's recording (its pieces all)
        self.closed = False
        self.busy = threading.Lock()  # held by each step (and by sleep, to wait for one)
        self.asleep: set[str] = set()  # what sleep() gave back that its graphs use
        self.arena: Arena | None = None  # its persistent buffers, where they can sleep
        memory.attach(self)  # a closed memory is refused here, before anything is held

    def release(self, buffers: bool = False) -> None:
        """Wait for queued work, reset every graph, close the memory if owned (idempotent).

        `buffers`: give the persistent input buffers back too (an explicit close, whose
        planner refuses from then on); else each goes with its last tensor. A driver failure
        is raised; the books keep what it refused, and closing the memory again finishes it.
        """
        if self.closed:
            if buffers:  # an earlier close that failed midway: finish it (both idempotent)
                self._give_back(buffers)
            return
        self.closed = True
        self.memory.detach(self)  # first: the memory's owner may close it from here on
        self.backend.synchronize()  # replays still queued on the device use this memory
        while self.graphs:
            _, entry = self.graphs.popitem()
            entry.graph.reset()  # every piece, the device check's too
        self._give_back(buffers)

    def _give_back(self, buffers: bool) -> None:
        """The buffers (or what of them went with their last tensors), then the memory if
        owned, even where the buffers' release failed (its error raised after)."""
        try:
            if self.arena is not None:
                if buffers:
                    self.arena.close()
                else:
                    self.arena.drain()  # what went with its last tensor, if deferred
        finally:
            if self.owns_memory:
                self.memory.close()


def _release_quietly(holdings: Holdings) -> None:
    try:
        holdings.release()
    except Exception:  # a finalizer must not raise: report it
        logger.exception("%s: releasing graph memory of a dropped executor failed", holdings.name)


def release_when_collected(owner: object, holdings: Holdings) -> weakref.finalize:
    """Release `holdings` when `owner` is garbage-collected, or at interpreter exit if it is
    still alive then (newest first). `finalizer.detach()` undoes it (an explicit close)."""
    finalizer = weakref.finalize(owner, _release_quietly, holdings)
    finalizer.atexit = True
    return finalizer
