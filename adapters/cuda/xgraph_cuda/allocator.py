"""The process-wide pluggable allocator behind every routed `torch.cuda.MemPool`.

torch's caching allocator still sits between tensors and a custom allocator: it asks the
allocator for whole segments and never says which capture asks. So every routed pool shares
one allocator made of two ctypes callbacks, and the graph names the segment allocator (the
"target", e.g. a SharedPhysicalPool AddressSpace) around each capture with `routing(target)`.
Each handed-out address remembers its target, so a free that torch issues later (empty_cache,
pool destruction, possibly after xgraph's pool was closed) reaches the right target; unknown
addresses are ignored. The callbacks never raise into torch: a failure is logged and an
allocation failure returns 0, which torch reports as out of memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any

from xgraph.interfaces import SegmentAllocator

logger = logging.getLogger("xgraph")

_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class _Router:
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
        """This thread's target; else the only one routed anywhere (torch may ask elsewhere)."""
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
                "xgraph CUDA allocator: a routed capture pool asked for %d bytes outside a "
                "capture (no routing target); reporting out of memory. Allocate from a "
                "routed pool only through CUDAGraph.capture_begin.",
                nbytes,
            )
            return 0
        address = int(target.alloc(nbytes) or 0)  # the target is called without our lock
        if address:
            with self._lock:
                self._live[address] = (target, nbytes)
                key = id(target)
                self._handed[key] = self._handed.get(key, 0) + nbytes
        return address

    def free(self, address: int, nbytes: int) -> None:
        with self._lock:
            entry = self._live.pop(address, None)
            if entry is not None:
                key = id(entry[0])
                left = self._handed.get(key, 0) - entry[1]
                if left > 0:
                    self._handed[key] = left
                else:
                    self._handed.pop(key, None)  # no live entry keeps the id from reuse now
        if entry is None:
            logger.debug("xgraph CUDA allocator: free of unknown address %#x ignored", address)
            return
        entry[0].free(address, entry[1])  # the target is called without our lock

    def handed_out(self, target: SegmentAllocator) -> int:
        with self._lock:
            return self._handed.get(id(target), 0)


_router = _Router()


def _alloc(size: int, device: int, stream: Any, _router: _Router = _router) -> int:
    """alloc(size, device, stream) for torch: an address, or 0 for out of memory."""
    try:
        return _router.alloc(int(size))
    except BaseException:  # never raise through C: torch would abort
        try:
            logger.exception("xgraph CUDA allocator: allocating %d bytes failed", size)
        except BaseException:
            pass
        return 0


def _free(ptr: int | None, size: int, device: int, stream: Any, _router: _Router = _router) -> None:
    """free(ptr, size, device, stream) for torch; may come at any time, even at exit."""
    try:
        if ptr:
            _router.free(int(ptr), int(size))
    except BaseException:
        try:
            logger.exception("xgraph CUDA allocator: freeing %#x failed", ptr or 0)
        except BaseException:
            pass


# module globals: the C function pointers must outlive every pool (a late empty_cache frees)
_ALLOC_CALLBACK = _ALLOC_FN(_alloc)
_FREE_CALLBACK = _FREE_FN(_free)
_allocator: Any = None
_allocator_lock = threading.Lock()


def get_allocator() -> Any:
    """The one `torch._C._cuda_CUDAAllocator` over the callbacks (created on first use)."""
    global _allocator
    with _allocator_lock:
        if _allocator is None:
            import torch

            alloc_ptr = ctypes.cast(_ALLOC_CALLBACK, ctypes.c_void_p).value
            free_ptr = ctypes.cast(_FREE_CALLBACK, ctypes.c_void_p).value
            _allocator = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
        return _allocator


@contextlib.contextmanager
def routing(target: SegmentAllocator) -> Iterator[SegmentAllocator]:
    """Send this thread's routed-pool segment requests to `target` until the block ends."""
    _router.push(target)
    try:
        yield target
    finally:
        _router.pop(target)


def current_target() -> SegmentAllocator | None:
    """The target a segment request from this thread would go to now."""
    return _router.current()


def handed_out(target: SegmentAllocator) -> int:
    """Bytes `target` handed to torch through this allocator that torch has not freed."""
    return _router.handed_out(target)
