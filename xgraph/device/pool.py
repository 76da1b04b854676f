"""MemPoolCapturePool: a torch MemPool as a capture pool, native or routed, with a keeper.

- native (segments=None): the runtime's caching allocator takes segments from the device;
- routed (segments=a SegmentAllocator): the MemPool's allocator is the runtime's pluggable
  allocator over xgraph.routing's callbacks (one per runtime), and `capturing()` routes this
  thread's segment requests to `segments`: torch never says which capture asks.

Rules of torch's caching allocators that the pool keeps for every device:
- The keeper: a one-op graph captured on the pool at creation and held until close. torch
  and torch_npu assert `use_count > 0` when a capture begins on a pool all of whose graphs
  were reset (the pinned-host allocator's record of the pool; torch_npu's device allocator
  up to 2.12, whose MemPool holds no use): the keeper is the pool's permanent last graph.
- Poisoned pools: a capture whose begin or end the runtime refused may leave the pool id
  routed in a host allocator no binding reaches, so the graph marks the pool `poisoned` and
  the core never captures on it again (GraphMemory replaces a poisoned shared pool).
- Parked pools: a closed pool's MemPool (and keeper) is dropped once no graph holds it and
  no capture runs on the device (some torch versions abort when a MemPool a graph uses is
  destroyed; a torch_npu MemPool dropped during any capture throws in its destructor).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import XGraphError
from ..interfaces import CapturePool, SegmentAllocator
from ..routing import callback_pointers, handed_out, routing
from .captures import allocator_lock, book
from .runtime import PoolId, TorchRuntime

logger = logging.getLogger("xgraph")

_lock = threading.Lock()
_allocators: weakref.WeakKeyDictionary[TorchRuntime, Any] = weakref.WeakKeyDictionary()
# per runtime, per thread: the keeper's stream and scratch tensor (a stream captures for one
# thread at a time: two threads making pools at once capture their keepers side by side)
_keeper_kits: weakref.WeakKeyDictionary[TorchRuntime, threading.local] = weakref.WeakKeyDictionary()


def routing_allocator(runtime: TorchRuntime) -> Any:
    """The runtime's pluggable allocator over xgraph.routing's callbacks (made on first use)."""
    with _lock:
        allocator = _allocators.get(runtime)
        if allocator is None:
            allocator = _allocators[runtime] = runtime.custom_allocator(*callback_pointers())
        return allocator


def mempool_use_count(mempool: Any) -> int | None:
    """torch's use count of a MemPool's pool; None where this torch cannot say."""
    fn = getattr(mempool, "use_count", None)
    if fn is None:
        return None
    with allocator_lock:
        return int(fn())


def pool_segment_bytes(runtime: TorchRuntime, pool_id: PoolId, mempool: Any) -> int:
    """Bytes of the segments the caching allocator holds for one pool id."""
    snap = getattr(mempool, "snapshot", None)
    with allocator_lock:
        if snap is None:
            segments = runtime.memory_snapshot()
        else:
            try:
                segments = snap(include_traces=False)
            except TypeError:  # older torch: no include_traces
                segments = snap()
    # filtered anyway: some torch versions' MemPool.snapshot() returns every pool's segments
    want = tuple(pool_id)
    return sum(
        int(s["total_size"]) for s in segments if tuple(s.get("segment_pool_id", ())) == want
    )


def undo_pool_capture(
    runtime: TorchRuntime, pool_id: PoolId, now: int | None, base: int | None
) -> None:
    """Give back what the runtime took of a pool for a capture it did not complete: this
    thread's allocation routing, and the capture's uses (`now` - `base`, the use counts
    after and before; where the runtime cannot count, a routed capture took one)."""
    with allocator_lock:
        try:
            runtime.end_allocate_to_pool(pool_id)
            routed = True
        except Exception:  # "not currently recording to mempool_id": nothing to undo
            routed = False
        taken = now - base if now is not None and base is not None else int(routed)
        try:
            for _ in range(taken):
                runtime.release_pool(pool_id)
        except Exception:
            logger.exception("releasing pool %s after a failed capture failed", pool_id)


def _thread_kits(runtime: TorchRuntime) -> threading.local:
    """This thread's keeper stream and scratch of `runtime` (`.kit`, None until made)."""
    with _lock:
        kits = _keeper_kits.get(runtime)
        if kits is None:
            kits = _keeper_kits[runtime] = threading.local()
    return kits


def keeper_graph(runtime: TorchRuntime, mempool: Any) -> Any:
    """A one-op graph captured on the pool (see the module docstring), on a stream of this
    thread's own: never one another thread's keeper captures on."""
    kits = _thread_kits(runtime)
    kit = getattr(kits, "kit", None)
    if kit is None:
        with torch.inference_mode(False):  # kept for good: add_ works in every mode
            scratch = torch.zeros(1, device=runtime.device)
        kit = kits.kit = (runtime.new_stream(), scratch)
    stream, scratch = kit
    pool_id: PoolId = tuple(mempool.id)  # type: ignore[assignment]
    base = mempool_use_count(mempool)
    g = runtime.new_graph()
    stream.wait_stream(runtime.current_stream())
    captures = book(runtime)
    captures.enter()
    try:
        with runtime.use_stream(stream):
            g.capture_begin(pool=pool_id, capture_error_mode="thread_local")
            try:
                scratch.add_(0)  # no allocation: nothing lands in the pool
            finally:
                g.capture_end()
    except BaseException:
        undo_pool_capture(runtime, pool_id, mempool_use_count(mempool), base)
        if runtime.is_capturing(stream) and not runtime.end_capture(stream):
            book(runtime).stuck(stream)
        kits.kit = None  # a new keeper stream for this thread next time
        raise
    finally:
        captures.exit()
    return g


class _Parked:
    """A closed pool's MemPool and keeper, dropped once no graph holds the pool."""

    def __init__(self, mempool: Any, keeper: Any) -> None:
        self.mempool, self.keeper = mempool, keeper

    def drop(self) -> bool:
        if self.keeper is not None:
            self.keeper.reset()
            self.keeper = None
        uses = mempool_use_count(self.mempool)
        if uses is not None and uses > 1:  # graphs captured on it still hold it
            return False
        with allocator_lock:
            self.mempool = None  # the last reference: its destructor gives the segments back
        return True


class MemPoolCapturePool(CapturePool):
    """A MemPool for captures; `.id` goes to the torch graph's capture_begin."""

    def __init__(self, runtime: TorchRuntime, segments: SegmentAllocator | None = None) -> None:
        super().__init__(segments)
        self.runtime = runtime
        allocator = routing_allocator(runtime) if segments is not None else None
        with allocator_lock:
            self._mempool: Any = runtime.new_mempool(allocator)
        self.id: PoolId = tuple(self._mempool.id)  # type: ignore[assignment]
        self._keeper: Any = None
        try:
            self._keeper = keeper_graph(runtime, self._mempool)
        except Exception as exc:
            self.close()
            raise XGraphError(
                f"A new capture pool could not capture its keeper graph ({exc}); the device "
                "refuses graph captures. Run `xgraph conformance` for this backend."
            ) from exc

    @property
    def mempool(self) -> Any:
        """The torch MemPool (None once closed)."""
        return self._mempool

    def use_count(self) -> int | None:
        """torch's use count of the pool (its MemPool, its keeper, +1 per graph holding it);
        None where this torch cannot say."""
        return mempool_use_count(self._mempool) if self._mempool is not None else 0

    def reserved_bytes(self) -> int:
        if self.segments is not None:
            return handed_out(self.segments)
        if self._mempool is None:
            return 0
        return pool_segment_bytes(self.runtime, self.id, self._mempool)

    def capturing(self) -> contextlib.AbstractContextManager[Any]:
        if self.segments is None:
            return contextlib.nullcontext()
        return _routed(self.segments)

    def allocating(self) -> contextlib.AbstractContextManager[Any] | None:
        """This thread's allocations in the block come from the pool and their segments from
        `segments` (memory regions), where the runtime has `use_mem_pool`."""
        if self.segments is None or self._mempool is None:
            return None
        place = self.runtime.use_mem_pool(self._mempool)
        return None if place is None else _allocating(self.segments, place)

    def _release(self) -> None:
        """Park the MemPool and keeper; they go once no graph holds the pool and no capture
        runs. Reset graphs captured on the pool before closing it."""
        keeper, self._keeper = self._keeper, None
        mempool, self._mempool = self._mempool, None
        uses = mempool_use_count(mempool)
        held = (uses or 0) - 1 - (keeper is not None)
        if held > 0:
            logger.warning(
                "%s.close: %d graph(s) captured on pool %s were not reset; its memory is "
                "released once they are (reset graphs before closing their pool).",
                type(self).__name__,
                held,
                self.id,
            )
        parked = _Parked(mempool, keeper)
        del mempool, keeper  # the parked entry holds the last references
        book(self.runtime).park(parked)

    def __repr__(self) -> str:
        kind = "routed" if self.segments is not None else "native"
        state = "closed" if self.closed else ("poisoned" if self.poisoned else "open")
        return f"<{type(self).__name__} {kind} id={self.id} {state}>"


@contextlib.contextmanager
def _routed(segments: SegmentAllocator) -> Iterator[None]:
    """This thread's segment requests go to `segments`, one routed thread at a time (see
    `allocator_lock`)."""
    with allocator_lock, routing(segments):
        yield


@contextlib.contextmanager
def _allocating(
    segments: SegmentAllocator, place: contextlib.AbstractContextManager[Any]
) -> Iterator[None]:
    with _routed(segments), place:
        yield
