"""Segment routing: the process-wide allocator callbacks behind every routed native pool.

A runtime's caching allocator (torch's for CUDA, torch_npu's for Ascend) sits between
tensors and a pluggable allocator: it asks for whole segments and never says which capture
asks. So every routed pool shares one pair of C callbacks made here, and the pool names the
segment allocator (the "target", e.g. a SharedPhysicalPool AddressSpace) around each capture
with `routing(target)` (CapturePool.capturing). Each handed-out address remembers its
target, so a free that comes later (empty_cache, pool destruction, possibly after xgraph's
pool was closed) reaches the right target; unknown addresses are ignored. The callbacks
never raise into C: a failure is logged and an allocation failure returns 0 (out of memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any

from .interfaces import SegmentAllocator

logger = logging.getLogger("xgraph")

# void* alloc(size_t size, int device, void* stream); void free(void* ptr, size_t, int, void*)
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class Router:
    """Current targets per thread, and which target handed out each live address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._routes: dict[int, list[SegmentAllocator]] = {}  # thread id -> stack of targets
        self._live: dict[int, tuple[SegmentAllocator, int]] = {}  # address -> (target, bytes)
        self._handed: dict[int, int] = {}  # id(target) -> bytes handed out and not freed

    def push(self, target: SegmentAllocator) -> None:
        with self._lock:
            self._routes.setdefault(threading.get_ident(), []).append(target)

    def pop(self, target: SegmentAllocator) -> None:
        with self._lock:
            tid = threading.get_ident()
            stack = self._routes.get(tid, [])
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is target:
                    del stack[i]
                    break
            if not stack:
                self._routes.pop(tid, None)

    def current(self) -> SegmentAllocator | None:
        """This thread's target; else the only one routed anywhere (the runtime may ask from
        a thread of its own)."""
        with self._lock:
            stack = self._routes.get(threading.get_ident())
            if stack:
                return stack[-1]
            tops = [s[-1] for s in self._routes.values() if s]
            return tops[0] if len(tops) == 1 else None

    def alloc(self, nbytes: int) -> int:
        target = self.current()
        if target is None:
            logger.error(
                "xgraph allocator: a routed capture pool asked for %d bytes outside a capture "
                "(no routing target); reporting out of memory. Allocate from a routed pool "
                "only inside Graph.capture_begin / capture_end.",
                nbytes,
            )
            return 0
        address = int(target.alloc(nbytes) or 0)  # the target is called without our lock
        if address:
            with self._lock:
                self._live[address] = (target, nbytes)
                self._handed[id(target)] = self._handed.get(id(target), 0) + nbytes
        return address

    def free(self, address: int, nbytes: int) -> None:
        with self._lock:
            entry = self._live.pop(address, None)
            if entry is not None:
                left = self._handed.get(id(entry[0]), 0) - entry[1]
                if left > 0:
                    self._handed[id(entry[0])] = left
                else:
                    self._handed.pop(id(entry[0]), None)  # the id may be reused from now on
        if entry is None:
            logger.debug("xgraph allocator: free of unknown address %#x ignored", address)
            return
        entry[0].free(address, entry[1])  # the target is called without our lock

    def handed_out(self, target: SegmentAllocator) -> int:
        with self._lock:
            return self._handed.get(id(target), 0)


router = Router()


def _alloc(size: int, device: int, stream: Any) -> int:
    """alloc(size, device, stream) for the runtime: an address, or 0 for out of memory."""
    try:
        return router.alloc(int(size))
    except BaseException:  # never raise through C: the runtime would abort
        try:
            logger.exception("xgraph allocator: allocating %d bytes failed", size)
        except BaseException:
            pass
        return 0


def _free(ptr: int | None, size: int, device: int, stream: Any) -> None:
    """free(ptr, size, device, stream) for the runtime; may come at any time, even at exit."""
    try:
        if ptr:
            router.free(int(ptr), int(size))
    except BaseException:
        try:
            logger.exception("xgraph allocator: freeing %#x failed", ptr or 0)
        except BaseException:
            pass


# module globals: the C function pointers must outlive every pool (a late empty_cache frees)
ALLOC_CALLBACK = ALLOC_FN(_alloc)
FREE_CALLBACK = FREE_FN(_free)


def callback_pointers() -> tuple[int, int]:
    """(alloc, free) as raw function pointers, for a runtime's pluggable-allocator constructor."""
    alloc = ctypes.cast(ALLOC_CALLBACK, ctypes.c_void_p).value
    free = ctypes.cast(FREE_CALLBACK, ctypes.c_void_p).value
    assert alloc is not None and free is not None
    return alloc, free


@contextlib.contextmanager
def routing(target: SegmentAllocator) -> Iterator[SegmentAllocator]:
    """Send this thread's routed-pool segment requests to `target` until the block ends."""
    router.push(target)
    try:
        yield target
    finally:
        router.pop(target)


def handed_out(target: SegmentAllocator) -> int:
    """Bytes `target` handed to the runtime through the callbacks that it has not freed."""
    return router.handed_out(target)
