"""CUDA graphs: CheckedGraph's four driver calls over torch.cuda.CUDAGraph on a side stream.

`_begin` synchronizes (as torch.cuda.graph does; its empty_cache is skipped, it would only
drop other pools' cached segments), moves the current stream to the backend's capture
stream and begins torch's capture on the pool in thread-local mode. `_reset` copes with
whatever a failed capture left: it ends a capture torch could not end, undoes torch's
bookkeeping of the pool, and restores the streams. The state machine, the pool checks, the
segment routing and the capture-safety guard are CheckedGraph's.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Protocol

import torch

from xgraph.errors import CaptureError, XGraphError
from xgraph.graphs import CheckedGraph
from xgraph.interfaces import CapturePool

from .pool import CUDACapturePool, release_parked


class _StreamOwner(Protocol):
    """What the graph needs of its backend (CUDABackend): its device and capture stream."""

    @property
    def device(self) -> torch.device: ...

    def capture_stream(self) -> torch.cuda.Stream: ...


logger = logging.getLogger("xgraph")


def _end_allocate_to_pool(device: int, pool_id: tuple[int, int]) -> bool:
    """Stop torch routing this thread's allocations to the pool; False if it was not."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
        torch._C, "_cuda_endAllocateCurrentStreamToPool", None
    )
    if end is None:
        return False
    try:
        end(device, pool_id)
        return True
    except Exception:  # "not currently recording to mempool_id": nothing to undo
        return False


def _force_end_capture(stream: torch.cuda.Stream) -> None:
    """End a capture torch could not end, through the driver, and drop its graph."""
    from cuda.bindings import driver as cu

    err, graph = cu.cuStreamEndCapture(stream.cuda_stream)
    if graph is not None and int(graph):
        cu.cuGraphDestroy(graph)
    if err != cu.CUresult.CUDA_SUCCESS:
        logger.debug("cuStreamEndCapture after a failed capture returned %s", err)


class CUDAGraph(CheckedGraph):
    """One torch.cuda.CUDAGraph; `_reset` replaces it, so the object can capture again."""

    pool_type = CUDACapturePool
    backend: _StreamOwner

    def __init__(self, backend: _StreamOwner) -> None:
        super().__init__(backend)
        self._g = torch.cuda.CUDAGraph()
        self._begun = False  # torch's capture_begin succeeded and its capture_end has not
        self._pool: CUDACapturePool | None = None
        self._base_use = 0  # the pool's use count before this capture began
        self._side: torch.cuda.Stream | None = None
        self._stack: contextlib.ExitStack | None = None  # device and stream switches

    def _begin(self, pool: CapturePool) -> None:
        assert isinstance(pool, CUDACapturePool)  # CheckedGraph checked pool_type
        device = self.backend.device
        if pool.device != device:
            raise XGraphError(
                f"capture_begin: the pool belongs to {pool.device}, this graph to {device}."
            )
        torch.cuda.synchronize(device)
        stack = self._stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(device))
        origin = torch.cuda.current_stream(device)
        side = self._side = self.backend.capture_stream()
        side.wait_stream(origin)
        # runs last on exit, once the stream is restored: later work sees the capture's
        stack.callback(origin.wait_stream, side)
        stack.enter_context(torch.cuda.stream(side))
        self._pool, self._base_use = pool, pool.use_count()
        self._g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        self._begun = True

    def _end(self) -> None:
        try:
            self._g.capture_end()
        except Exception as exc:
            raise CaptureError(
                f"Capture failed: CUDA could not record the forward ({exc}). An op in it is "
                "not capturable (a synchronizing call, a host copy, a CUDA API call not allowed "
                "during capture, or work on a stream that did not join the capture stream). "
                "Run the forward eagerly to find it, or leave it out of the captured forward."
            ) from exc
        self._begun = False
        self._close_stack()

    def _replay(self) -> None:
        self._g.replay()

    def _reset(self) -> None:
        try:
            if self._begun:
                self._end_failed_capture()
            self._close_stack()
            self._g.reset()
        finally:
            # a fresh torch graph: torch refuses a second capture on an instance that had one
            self._g = torch.cuda.CUDAGraph()
            self._pool = None
            self._side = None
            release_parked()

    # -- after a failed capture ------------------------------------------------------------

    def _close_stack(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _end_failed_capture(self) -> None:
        """End torch's capture on the side stream; if torch cannot, undo it by hand."""
        try:
            with torch.cuda.stream(self._side) if self._side else contextlib.nullcontext():
                self._g.capture_end()
            self._begun = False
            return
        except Exception:  # the capture already failed; its own error is the one to report
            pass
        self._begun = False
        self._undo_pool_capture()
        side = self._side
        if side is None:
            return
        try:
            with torch.cuda.stream(side):
                if torch.cuda.is_current_stream_capturing():
                    _force_end_capture(side)
                if torch.cuda.is_current_stream_capturing():
                    logger.error("CUDAGraph: the capture stream is still capturing after abort")
        except Exception:
            logger.exception("CUDAGraph: ending a failed capture on the driver failed")

    def _torch_capture_ended(self) -> bool:
        try:
            self._g.pool()  # raises unless torch's capture_end completed
            return True
        except Exception:
            return False

    def _undo_pool_capture(self) -> None:
        """Undo what torch's capture_begin did to the pool when its capture_end did not finish."""
        # capture_begin routes this thread's allocations to the pool and takes a use of it;
        # only a completed capture_end / reset give them back. Left as is, the next capture
        # on the pool fails ("already recording to mempool_id") and the pool is never freed.
        pool = self._pool
        if pool is None or pool.mempool is None or self._torch_capture_ended():
            return
        device = self.backend.device.index
        _end_allocate_to_pool(device, pool.id)
        release = getattr(torch._C, "_cuda_releasePool", None)
        if release is None:
            return
        try:
            for _ in range(pool.use_count() - max(self._base_use, 1)):
                release(device, pool.id)
        except Exception:
            logger.exception("CUDAGraph: releasing pool %s after a failed capture failed", pool.id)
