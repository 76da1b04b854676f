"""The CUDA backend's capture pool: a `torch.cuda.MemPool`, native or routed.

- native (segments=None): torch's caching allocator takes segments with cudaMalloc;
- routed (segments=a SegmentAllocator): the pool's allocator is xgraph's process-wide one
  (xgraph.routing), and `capturing()` routes its segment requests to `segments`.
A CUDAGraph captured on the pool holds a use of it until the graph is reset, so reset the
graphs before close(): torch then frees the pool's cached segments (routed ones through the
allocator's free callback, back to their target). A pool closed while a graph still holds
it is parked and destroyed once its last graph is reset (some torch versions abort when a
MemPool that a graph still uses is destroyed).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from xgraph.interfaces import CapturePool, SegmentAllocator
from xgraph.routing import handed_out, routing

from .allocator import get_allocator

logger = logging.getLogger("xgraph")

_parked: list[Any] = []  # MemPools closed while a graph still used them
_parked_lock = threading.Lock()


def _use_count(mempool: Any) -> int:
    fn = getattr(mempool, "use_count", None)
    return int(fn()) if fn is not None else 1


def release_parked() -> None:
    """Destroy parked MemPools that no graph uses any more (called on close and graph reset)."""
    with _parked_lock:
        done = [p for p in _parked if _use_count(p) <= 1]
        _parked[:] = [p for p in _parked if _use_count(p) > 1]
    del done  # the last references: each MemPool's destructor releases its segments


def pool_segments_bytes(pool_id: tuple[int, int], mempool: Any = None) -> int:
    """Total size of the segments torch's caching allocator holds for one pool id."""
    snap = getattr(mempool, "snapshot", None) if mempool is not None else None
    if snap is not None:
        try:
            segments = snap(include_traces=False)
        except TypeError:  # older torch: no include_traces
            segments = snap()
    else:
        segments = torch.cuda.memory_snapshot()
    # filter anyway: some torch versions' MemPool.snapshot() returns every pool's segments
    want = tuple(pool_id)
    return sum(
        int(s["total_size"]) for s in segments if tuple(s.get("segment_pool_id", ())) == want
    )


_keeper_lock = threading.Lock()
_keeper_state: dict[torch.device, tuple[torch.cuda.Stream, torch.Tensor]] = {}


def _keeper_graph(pool_id: tuple[int, int], device: torch.device) -> torch.cuda.CUDAGraph:
    """A one-kernel graph captured on the pool, held until close.

    torch's pinned-host allocator keeps its own record of each graph pool and drops it with
    the pool's last graph; a later capture on the same pool then fails an internal assert
    and leaves the RNG in capture state. The keeper is that pool's permanent last graph, so
    a pool can be captured on again after every other graph on it was reset.
    """
    with _keeper_lock:
        state = _keeper_state.get(device)
        if state is None:
            with torch.cuda.device(device):
                state = (torch.cuda.Stream(device), torch.zeros(1, device=device))
            _keeper_state[device] = state
    stream, scratch = state
    g = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.device(device), torch.cuda.stream(stream):
        g.capture_begin(pool=pool_id, capture_error_mode="thread_local")
        scratch.add_(0)  # no allocation: nothing lands in the pool
        g.capture_end()
    return g


class CUDACapturePool(CapturePool):
    """A torch.cuda.MemPool for captures; `.id` goes to capture_begin, `.segments` to routing."""

    def __init__(
        self, segments: SegmentAllocator | None = None, device: torch.device | None = None
    ) -> None:
        super().__init__(segments)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # a MemPool belongs to the device current at its construction
        with torch.cuda.device(device):
            if segments is None:
                self._mempool: Any = torch.cuda.MemPool()
            else:
                self._mempool = torch.cuda.MemPool(get_allocator())
        self.id: tuple[int, int] = tuple(self._mempool.id)  # type: ignore[assignment]
        self._keeper: torch.cuda.CUDAGraph | None = _keeper_graph(self.id, device)

    @property
    def mempool(self) -> Any:
        """The torch.cuda.MemPool (None once closed)."""
        return self._mempool

    def use_count(self) -> int:
        """torch's use count of the pool: the MemPool, its keeper, and +1 per graph holding it."""
        return _use_count(self._mempool) if self._mempool is not None else 0

    def reserved_bytes(self) -> int:
        if self.segments is not None:
            return handed_out(self.segments)
        return pool_segments_bytes(self.id, self._mempool)

    def capturing(self) -> contextlib.AbstractContextManager[Any]:
        """torch never says which capture asks for a segment: route this thread's requests."""
        if self.segments is None:
            return contextlib.nullcontext()
        return routing(self.segments)

    def allocating(self) -> contextlib.AbstractContextManager[Any] | None:
        """This thread's CUDA allocations in the block come from the pool, their segments from
        `segments` (xgraph.memory_region: torch.cuda.use_mem_pool over the routed allocator)."""
        if self.segments is None:
            return None
        return _allocating(self._mempool, self.segments, self.device)

    def _release(self) -> None:
        """Drop the MemPool so torch frees its segments; reset graphs captured on it first."""
        # tensors captured on the pool must be dead too: torch keeps a segment with a live
        # block and frees it later, outside the pool (pytorch#146431)
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.reset()
        mempool, self._mempool = self._mempool, None
        if _use_count(mempool) > 1:
            logger.warning(
                "CUDACapturePool.close: %d graph(s) captured on pool %s were not reset; its "
                "memory is released once they are (reset graphs before closing their pool).",
                _use_count(mempool) - 1,
                self.id,
            )
            with _parked_lock:
                _parked.append(mempool)
        del mempool  # the MemPool's destructor releases the pool and empties its cache
        release_parked()

    def __repr__(self) -> str:
        kind = "routed" if self.segments is not None else "native"
        state = "closed" if self.closed else "open"
        return f"<CUDACapturePool {kind} id={self.id} {state}>"


@contextlib.contextmanager
def _allocating(mempool: Any, segments: SegmentAllocator, device: torch.device) -> Iterator[None]:
    with routing(segments), torch.cuda.use_mem_pool(mempool, device):
        yield
