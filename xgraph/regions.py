"""Memory regions: the user's own device tensors (weights, the KV cache) under a tag, in
memory that sleep gives back and wake restores at the same addresses.

    with xgraph.memory_region("weights"):
        model = build_model(device=backend.device)
    with xgraph.memory_region("kv_cache"):
        cache = xgraph.PagedKVCache(...)

Inside the block, this thread's allocations on the backend's device come from a native pool
of the backend made with the region as its segment allocator (`Backend.new_pool(segments=
region)`, entered through `CapturePool.allocating()`), the way a capture pool takes its
segments from a SharedPhysicalPool: each segment the runtime's caching allocator asks for is
one reservation of the backend's VirtualMemory with one chunk mapped at its start. Tensors
work as before, and graphs captured over them keep their addresses across a sleep.

`xgraph.sleep(tags=..., offload=...)` copies the offloaded regions to host memory and gives
every chunk back, covering each segment with the scratch chunk (a slept tensor touched reads
and writes it instead of faulting); `xgraph.wake` maps fresh memory at the same addresses
and copies the bytes back; a dropped region comes back zeroed. A region lives as long as the
process (as the pools of vLLM's sleep allocator do): tensors freed in it return to its pool
and serve later allocations in the same region. Blocks do not nest, and nothing is captured
inside one (`refuse_capture_inside`): a capture's allocations would land in the region.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator

from .errors import AsleepError, XGraphError
from .interfaces import Backend, CapturePool
from .restorable import RestorableSegments
from .routing import routing

logger = logging.getLogger("xgraph")

_local = threading.local()  # the region this thread allocates in, if any
_lock = threading.Lock()
_regions: list[Region] = []  # every region made in this process


class Region:
    """One tag's memory on one backend: a SegmentAllocator for its native pool."""

    def __init__(self, tag: str, backend: Backend) -> None:
        self.tag, self.backend = tag, backend
        vm = backend.virtual_memory()
        support = backend.segments_support()
        why = None
        if vm is None:
            why = "it has no virtual memory"
        elif not support.available:
            why = support.reason
        else:
            self.segments = RestorableSegments(backend, vm, f"memory region {tag!r}")
            self.pool: CapturePool = backend.new_pool(segments=self)
            if self.pool.allocating() is None:
                self.pool.close()
                why = "its pools cannot take allocations outside a capture (CapturePool.allocating)"
        if why is not None:
            raise XGraphError(
                f"memory_region({tag!r}): backend {backend.name!r} cannot place tensors in "
                f"memory that sleep gives back: {why}. Allocate these tensors as usual; "
                "executor sleep still gives graph memory back."
            )
        self.failure: XGraphError | None = None  # why the last segment request got nothing

    # -- SegmentAllocator (called by the runtime's caching allocator) ----------------------

    def alloc(self, nbytes: int) -> int:
        try:
            return self.segments.add(nbytes).address
        except XGraphError as exc:  # the runtime gets 0 (out of memory); the block says why
            logger.error("memory region %r: %d bytes failed: %s", self.tag, nbytes, exc)
            self.failure = exc
            return 0

    def free(self, address: int, nbytes: int) -> None:
        self.segments.remove(address)

    # -- allocation, sleep and wake --------------------------------------------------------

    @contextlib.contextmanager
    def allocating(self) -> Iterator[Region]:
        """This thread's allocations on the device come from the region in the block."""
        outer = getattr(_local, "region", None)
        if outer is not None:
            raise XGraphError(
                f"memory_region({self.tag!r}) inside memory_region({outer.tag!r}): blocks do "
                "not nest. Close the outer block first."
            )
        if self.asleep:
            raise AsleepError(
                f"memory region {self.tag!r} is asleep; call xgraph.wake() before allocating."
            )
        place = self.pool.allocating()
        assert place is not None  # checked at construction
        self.failure = None
        _local.region = self
        try:
            with routing(self), place:
                yield self
        except Exception as exc:
            if self.failure is not None:  # the runtime's bare out-of-memory: say why
                raise XGraphError(f"memory region {self.tag!r}: {self.failure}") from exc
            raise
        finally:
            _local.region = None

    def sleep(self, offload: bool) -> tuple[int, int]:
        """Give the memory back, copying it to host memory first if `offload`; returns
        (bytes given back, bytes copied)."""
        return self.segments.release(lambda s: offload)

    def wake(self, commit: bool = True) -> int:
        return self.segments.restore(commit)

    @property
    def asleep(self) -> bool:
        return self.segments.asleep

    @property
    def nbytes(self) -> int:
        """Bytes of the region's segments (tensors and the pool's cached free blocks)."""
        return self.segments.nbytes

    def __repr__(self) -> str:
        state = "asleep" if self.asleep else "awake"
        return f"<memory region {self.tag!r} on {self.backend.name}: {self.nbytes} B, {state}>"


def region(tag: str, backend: Backend) -> Region:
    """The backend's region of `tag`, made on first use."""
    if not isinstance(tag, str) or not tag:
        raise XGraphError(f"memory_region: the tag must be a non-empty string, got {tag!r}.")
    with _lock:
        for r in _regions:
            if r.backend is backend and r.tag == tag:
                return r
        made = Region(tag, backend)
        _regions.append(made)
        return made


def regions(backend: Backend | None = None, tags: Iterable[str] | None = None) -> list[Region]:
    """The regions made so far (of `backend`, with one of `tags`), oldest first."""
    wanted = None if tags is None else set(tags)
    with _lock:
        return [
            r
            for r in _regions
            if (backend is None or r.backend is backend) and (wanted is None or r.tag in wanted)
        ]


def refuse_capture_inside(what: str) -> None:
    """Raise if this thread is inside a memory_region block (captures must not be)."""
    r = getattr(_local, "region", None)
    if r is not None:
        raise XGraphError(
            f"{what} inside memory_region({r.tag!r}): the capture's allocations would land in "
            "the region. Capture outside the block."
        )
