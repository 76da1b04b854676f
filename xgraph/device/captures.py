"""Which threads are capturing on a device, and the pools waiting for every capture to end.

Runtimes refuse some calls while any stream of the device captures, whatever the thread: an
Ascend device synchronize fails (107027), and a torch_npu MemPool dropped then throws in its
destructor, which aborts the process. The layer therefore counts its captures per runtime
(`book(runtime)`): `TorchBackend.synchronize` falls back to the calling thread's stream while
another thread captures (and holds the book while it synchronizes the device, so no capture
begins meanwhile), `empty_cache` waits for a quiet moment, and closed pools are parked
here and dropped by `drain` once no capture runs. A capture stream given up while still
capturing is remembered too: while it captures, device-wide calls would fail.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from .runtime import TorchRuntime

# One thread at a time where torch's caching allocator and Python meet: a routed pool's
# segment requests run Python inside the allocator's mutex (they need the GIL), and torch's
# bindings over that mutex (a MemPool made, read, dropped; the cache emptied; a capture's
# pool use given back) hold the GIL while they wait for it. A routed capture or allocation
# holds this lock throughout and each of those calls takes it, so neither waits for the
# other's half (a deadlock of two threads). Taken before a book's own lock; the book takes
# it without waiting (a held one means a routed capture or allocation runs: later).
allocator_lock = threading.RLock()


class Parked(Protocol):
    """Something held until no capture runs; `drop()` says whether it is gone for good."""

    def drop(self) -> bool: ...


class CaptureBook:
    """Running captures by thread, and parked pools, of one runtime."""

    def __init__(self, runtime: TorchRuntime) -> None:
        self._runtime = weakref.ref(runtime)
        self._lock = threading.RLock()  # drops run under it: no capture begins meanwhile
        self._threads: Counter[int] = Counter()
        self._parked: list[Parked] = []
        self._stuck: list[Any] = []  # streams given up while still capturing

    def enter(self) -> None:
        """A capture begins in this thread (called before the runtime's begin; waits for a
        synchronize in flight, see `synchronize`)."""
        with self._lock:
            self._threads[threading.get_ident()] += 1

    def exit(self) -> None:
        """A capture of this thread ended (or was given up); drops parked pools if quiet."""
        with self._lock:
            me = threading.get_ident()
            self._threads[me] -= 1
            if self._threads[me] <= 0:
                del self._threads[me]
        self.drain()

    def stuck(self, stream: Any) -> None:
        """A stream was given up while it still captures (its capture could not be ended)."""
        with self._lock:
            self._stuck.append(stream)

    def any_stuck(self) -> bool:
        """Whether a stream given up is still capturing (a device synchronize would fail);
        the driver is asked again to end each one (what failed once may work now)."""
        with self._lock:
            runtime = self._runtime()
            if runtime is not None and self._stuck:
                self._stuck = [s for s in self._stuck if _still_capturing(runtime, s)]
            return bool(self._stuck)

    def synchronize(self, device: Callable[[], None], stream: Callable[[], None]) -> None:
        """Synchronize the device with `device()`, or this thread's stream with `stream()`
        while another thread captures (or a given-up stream still does). The check and the
        device synchronize hold the lock, which every counted capture takes before its begin:
        no capture begins between them (one would make the device synchronize fail)."""
        with self._lock:
            me = threading.get_ident()
            others = any(t != me for t in self._threads)
            if not ((others and me not in self._threads) or self.any_stuck()):
                device()
                self.drain()  # pools parked behind a capture that has ended since
                return
        stream()  # outside the lock: a stream synchronize is allowed while others capture

    def _quiet(self) -> bool:
        """No capture runs on the device, not even one that could not be ended."""
        return not self._threads and not self.any_stuck()

    def park(self, item: Parked) -> None:
        with self._lock:
            self._parked.append(item)
        self.drain()

    def when_quiet(self, fn: Any) -> bool:
        """Run `fn()` if no capture runs (none begins meanwhile); whether it ran."""
        if not allocator_lock.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if not self._quiet():
                    return False
                fn()
                return True
        finally:
            allocator_lock.release()

    def parked(self) -> int:
        with self._lock:
            return len(self._parked)

    def drain(self) -> None:
        """Drop what is parked and ready, unless a capture runs (none begins meanwhile)."""
        if not allocator_lock.acquire(blocking=False):
            return  # the next drain drops them (every capture's end drains)
        try:
            with self._lock:
                if self._quiet():
                    self._parked = [item for item in self._parked if not item.drop()]
        finally:
            allocator_lock.release()


def _still_capturing(runtime: TorchRuntime, stream: Any) -> bool:
    if not runtime.is_capturing(stream):
        return False
    try:
        runtime.end_capture(stream)
    except Exception:  # the driver still refuses (another thread's capture, for example)
        return True
    return runtime.is_capturing(stream)


_books: weakref.WeakKeyDictionary[TorchRuntime, CaptureBook] = weakref.WeakKeyDictionary()
_books_lock = threading.Lock()


def book(runtime: TorchRuntime) -> CaptureBook:
    """The capture book of `runtime` (made on first use)."""
    with _books_lock:
        found = _books.get(runtime)
        if found is None:
            found = _books[runtime] = CaptureBook(runtime)
        return found


def when_no_capture(runtime: TorchRuntime, fn: Callable[[], Any]) -> bool:
    """Run `fn()` if no capture runs on `runtime`'s device (none begins meanwhile, see
    CaptureBook); whether it ran. For calls that fail during any capture (empty_cache)."""
    return book(runtime).when_quiet(fn)
