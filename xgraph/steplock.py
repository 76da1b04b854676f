"""StepLock: one step at a time over one graph memory, whichever executor takes it.

Executors that share a GraphMemory (or a SharedPhysicalPool) share physical memory between
their graphs: two replays at once would write each other's intermediates. Every replay and
capture of such an executor holds the lock of the memory (of the physical pool when there is
one), so steps from several threads run one after the other, each as if alone. A step that
would wait for the thread it runs on (a forward calling another executor over the same
memory) raises ConcurrentStepError instead of deadlocking.
"""

from __future__ import annotations

import threading

from .errors import ConcurrentStepError


class StepLock:
    """A lock that blocks other threads and refuses the thread that holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self, name: str) -> None:
        """Wait for any other thread's step over this memory; refuse a nested one."""
        me = threading.get_ident()
        # uncontended: one acquire, no wait (`blocking` by position: a keyword costs about
        # as much as the call)
        if not self._lock.acquire(False):
            if self._owner == me:
                raise ConcurrentStepError(
                    f"{name}: a step was started while this thread is inside another step over "
                    "the same graph memory (a forward calling an executor that shares its "
                    "memory). Their graphs share physical memory, so one would overwrite the "
                    "other's intermediates: call the executors one after the other."
                )
            self._lock.acquire()
        self._owner = me

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def held_here(self) -> bool:
        """Whether this thread holds the lock (a step calling into sleep, say)."""
        return self._owner == threading.get_ident()

    def locked(self) -> bool:
        """Whether a step holds the lock now (tests, diagnostics)."""
        return self._lock.locked()
