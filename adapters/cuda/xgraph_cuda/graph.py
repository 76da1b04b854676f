"""CUDA graphs: torch.cuda.CUDAGraph on a side stream, guarded against host reads.

capture_begin synchronizes (as torch.cuda.graph does; its empty_cache is skipped, it would
only drop other pools' cached segments), moves the current stream to the backend's capture
stream, routes a routed pool's segment requests to its target, begins the capture on the
pool, and enters a guard: a TorchDispatchMode that runs `xgraph.safety.check_op` before each
op, so `.item()`, `nonzero`, `.cpu()` and the like raise CaptureError naming the op and the
model line before CUDA invalidates the capture. capture_end and abort undo all of it in
reverse order; abort copes with whatever state a failed capture left behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xgraph import safety
from xgraph.errors import CaptureError, PoolClosedError, XGraphError
from xgraph.interfaces import CapturePool, Graph
from xgraph.safety import block_host_conversions, check_op

from .allocator import routing
from .pool import CUDACapturePool, release_parked

logger = logging.getLogger("xgraph")

# frames of this package are library code: CaptureError names the model's line, not ours
safety.register_library_path(os.path.dirname(os.path.abspath(__file__)))


class _CaptureGuard(TorchDispatchMode):
    """Refuse, before they run, ops that would read device data on the host."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        check_op(func, args, kwargs, self.device)
        return func(*args, **kwargs)


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


class CUDAGraph(Graph):
    """One torch.cuda.CUDAGraph; reset() replaces it, so the object can capture again."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._g = torch.cuda.CUDAGraph()
        self._capturing = False
        self._captured = False
        self._begun = False  # torch's capture_begin succeeded and capture_end has not
        self._pool: CUDACapturePool | None = None
        self._base_use = 0  # the pool's use count before this capture began
        self._side: torch.cuda.Stream | None = None
        self._stack: contextlib.ExitStack | None = None  # device, streams, routing
        self._guard: contextlib.ExitStack | None = None  # dispatch guard, host conversions

    # -- capture ---------------------------------------------------------------------------

    def capture_begin(self, pool: CapturePool) -> None:
        if self._capturing:
            raise XGraphError("capture_begin: this graph is already capturing; call capture_end.")
        if not isinstance(pool, CUDACapturePool):
            raise XGraphError(
                f"capture_begin: the CUDA graph needs a pool from CUDABackend.new_pool(), got "
                f"{type(pool).__name__}."
            )
        if pool.closed:
            raise PoolClosedError("capture_begin: the pool is closed; create a new one.")
        if self._captured:
            raise XGraphError(
                "capture_begin: this graph already holds a capture; reset() it first."
            )
        device = self.backend.device
        if pool.device != device:
            raise XGraphError(
                f"capture_begin: the pool belongs to {pool.device}, this graph to {device}."
            )
        torch.cuda.synchronize(device)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch.cuda.device(device))
            origin = torch.cuda.current_stream(device)
            side = self.backend.capture_stream()
            side.wait_stream(origin)
            # runs last on exit, once the stream is restored: later work sees the capture's
            stack.callback(origin.wait_stream, side)
            stack.enter_context(torch.cuda.stream(side))
            if pool.segments is not None:
                stack.enter_context(routing(pool.segments))
            self._side, self._pool, self._base_use = side, pool, pool.use_count()
            self._g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        except BaseException:
            self._undo_pool_capture()
            stack.close()
            self._side = self._pool = None
            raise
        self._stack = stack
        self._begun = True
        guard = contextlib.ExitStack()
        try:
            guard.enter_context(block_host_conversions())
            guard.enter_context(_CaptureGuard(device))
        except BaseException:
            guard.close()
            self._capturing = True
            self.abort()
            raise
        self._guard = guard
        self._capturing = True

    def capture_end(self) -> None:
        if not self._capturing:
            raise XGraphError("capture_end: no capture in progress.")
        self._exit_guard()
        self._capturing = False
        try:
            self._g.capture_end()
        except Exception as exc:
            self._after_failed_end()
            self._close_stack()
            raise CaptureError(
                f"Capture failed: CUDA could not record the forward ({exc}). An op in it is "
                "not capturable (a synchronizing call, a host copy, a CUDA API call not allowed "
                "during capture, or work on a stream that did not join the capture stream). "
                "Run the forward eagerly to find it, or leave it out of the captured forward."
            ) from exc
        self._begun = False
        self._captured = True
        self._close_stack()

    # -- replay ----------------------------------------------------------------------------

    def replay(self) -> None:
        if self._capturing:
            raise XGraphError("replay: the graph is still capturing; call capture_end first.")
        if not self._captured:
            raise XGraphError("replay: nothing captured; call capture_begin / capture_end first.")
        if self._pool is not None and self._pool.closed:
            raise PoolClosedError(
                "replay: the pool this graph was captured on is closed; capture it again."
            )
        self._g.replay()

    def reset(self) -> None:
        if self._capturing or self._begun or self._stack is not None or self._guard is not None:
            self._teardown_capture()
        try:
            self._g.reset()
        finally:
            # a fresh torch graph: torch refuses a second capture on an instance that had one
            self._g = torch.cuda.CUDAGraph()
            self._captured = False
            self._pool = None
            self._side = None
            release_parked()

    def abort(self) -> None:
        """End a failed capture whatever state it left, then reset; never leaves a capture on."""
        try:
            self._teardown_capture()
        finally:
            self.reset()

    # -- teardown helpers ------------------------------------------------------------------

    def _exit_guard(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            try:
                guard.close()
            except Exception:
                logger.exception("CUDAGraph: leaving the capture guard failed")

    def _close_stack(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _teardown_capture(self) -> None:
        self._exit_guard()
        self._capturing = False
        if self._begun:
            try:
                if self._side is not None:
                    with torch.cuda.stream(self._side):
                        self._g.capture_end()
                else:
                    self._g.capture_end()
                self._begun = False
            except Exception:  # the capture already failed; its own error is the one to report
                self._after_failed_end()
        self._close_stack()

    def _after_failed_end(self) -> None:
        """After capture_end raised: undo torch's pool bookkeeping, leave capture mode."""
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
