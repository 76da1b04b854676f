"""StreamGraph: CheckedGraph's four driver calls over a torch graph on a capture stream.

`_begin` synchronizes (as torch.cuda.graph does; its empty_cache is skipped: it would drop
other pools' cached segments), moves this thread to the backend's capture stream (torch
refuses to capture the default stream) and begins the runtime's capture on the pool in
thread_local mode, which the core's per-thread capture guard relies on. `_reset` copes with
whatever a failed capture left, in every runtime's way at once:
- a capture never ended is ended through the runtime's capture_end, which runs at most once
  per capture (a second call asserts on torch_npu and miscounts another thread's capture);
- a capture the runtime could not end is ended through the driver (`end_capture`) where the
  stream still captures (most runtimes take it out of capture when their end fails), and
  this thread's capture stream is given up for a new one (a stream left capturing refuses
  every later capture);
- the pool: this thread's allocation routing and the capture's uses are given back, and a
  pool whose capture the runtime refused at begin or end is marked poisoned;
- the torch graph is replaced by a fresh one: torch refuses a second capture on one object.
A capture kept readable (`keep_launches`, for the parameterization check) runs on the
runtime's `readable_graph`, and its launches come from `graph_launches`.
The state machine, pool checks, routing and capture-safety guard are CheckedGraph's. This
class does not stage inputs or choose pools: GraphExecutor and GraphMemory do.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ..errors import CaptureError, XGraphError
from ..graphs import CheckedGraph
from ..interfaces import CapturePool, Launch
from .captures import book
from .pool import MemPoolCapturePool, undo_pool_capture

if TYPE_CHECKING:
    from .backend import TorchBackend

logger = logging.getLogger("xgraph")


class StreamGraph(CheckedGraph):
    """One torch graph of the backend's runtime; `_reset` replaces it, so it captures again."""

    pool_type = MemPoolCapturePool
    backend: TorchBackend

    def __init__(self, backend: TorchBackend) -> None:
        super().__init__(backend)
        self.runtime = backend.runtime
        self._g = self.runtime.new_graph()
        self._clear()

    def _clear(self) -> None:
        self._pool: MemPoolCapturePool | None = None
        self._base_use: int | None = None  # the pool's use count before this capture began
        self._side: Any = None  # the capture stream
        self._counted = False  # this capture is in the device's capture book
        self._begun = False  # the runtime's capture_begin returned
        self._ended = False  # the runtime's capture_end was called (once per capture)
        self._end_failed = False
        self._captured = False
        self._streams: contextlib.ExitStack | None = None
        self._recording: contextlib.ExitStack | None = None

    @property
    def runtime_graph(self) -> Any:
        """The runtime's graph object this captures on (a readable one after keep_launches):
        what an adapter's own calls on a captured graph read (PDL's edge count)."""
        return self._g

    # -- what an adapter may refine ----------------------------------------------------------

    def capture_error(self, exc: BaseException, call: str) -> XGraphError:
        """The error for a runtime's refusal of `call` (capture_begin, capture_end)."""
        return CaptureError(
            f"Capture failed: the runtime's {call} refused the capture ({exc}). An op in the "
            "forward is not capturable (a synchronizing call, a host copy, a runtime call not "
            "allowed during capture, or work on a stream that did not join the capture "
            "stream). Run the forward eagerly to find it, or leave it out of the captured "
            "forward."
        )

    def replay_error(self, exc: BaseException) -> XGraphError | None:
        """An xgraph error for a failed replay, or None to let the runtime's error through."""
        return None

    def recording_context(self) -> AbstractContextManager[Any]:
        """Entered while the capture records (after the runtime's begin, left before its
        end): an adapter's translation of runtime errors raised by ops, for example."""
        return contextlib.nullcontext()

    # -- the driver calls ------------------------------------------------------------------

    def _begin(self, pool: CapturePool) -> None:
        assert isinstance(pool, MemPoolCapturePool)  # CheckedGraph checked pool_type
        rt = self.runtime
        if pool.runtime is not rt:
            raise XGraphError("capture_begin: the pool belongs to another device's runtime.")
        self.backend.synchronize()
        streams = self._streams = contextlib.ExitStack()
        origin, side = rt.current_stream(), self.backend.capture_stream()
        self._side = side
        side.wait_stream(origin)
        # runs last on exit, once the stream is restored: later work sees the capture's
        streams.callback(origin.wait_stream, side)
        streams.enter_context(rt.use_stream(side))
        self._pool, self._base_use = pool, pool.use_count()
        book(rt).enter()
        self._counted = True
        try:
            self._g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        except Exception as exc:
            pool.poisoned = True
            raise self.capture_error(exc, "capture_begin") from exc
        self._begun = True
        self._recording = contextlib.ExitStack()
        self._recording.enter_context(self.recording_context())

    def _end(self) -> None:
        self._leave("_recording")
        self._ended = True
        try:
            self._g.capture_end()
        except Exception as exc:
            self._end_failed = True
            assert self._pool is not None
            self._pool.poisoned = True
            raise self.capture_error(exc, "capture_end") from exc
        self._captured = True
        self._leave("_streams")
        self._uncount()

    def _keep_launches(self) -> bool:
        g = self.runtime.readable_graph()
        if g is None:
            return False
        self._g = g  # idle: nothing captured on the graph it replaces
        return True

    def _launches(self) -> list[Launch]:
        return self.runtime.graph_launches(self._g)

    def _replay(self) -> None:
        try:
            self._g.replay()
        except Exception as exc:
            err = self.replay_error(exc)
            if err is None:
                raise
            raise err from exc

    def _reset(self) -> None:
        failed = self._pool is not None and not self._captured
        try:
            self._leave("_recording")
            if failed and self._begun:
                self._end_failed_capture()
            self._leave("_streams")
            self._reset_runtime_graph(quiet=failed)
            if failed:
                self._undo_pool()
        finally:
            self._g = self.runtime.new_graph()
            self._uncount()
            self._clear()
            book(self.runtime).drain()  # pools parked until this graph let go of them

    # -- after a failed capture ------------------------------------------------------------

    def _leave(self, name: str) -> None:
        stack = getattr(self, name)
        setattr(self, name, None)
        if stack is not None:
            stack.close()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            book(self.runtime).exit()

    def _reset_runtime_graph(self, quiet: bool) -> None:
        try:
            self._g.reset()
        except Exception:
            if not quiet:
                raise
            logger.debug("%s: reset after a failed capture failed", type(self).__name__)

    def _end_failed_capture(self) -> None:
        """End a capture that failed: through the runtime once, else through the driver."""
        rt, side = self.runtime, self._side
        if not self._ended:
            self._ended = True
            try:
                with rt.use_stream(side):
                    self._g.capture_end()
                return  # ended: the torch graph holds its use until the reset
            except Exception:
                logger.debug("capture_end after a failed capture failed", exc_info=True)
                self._end_failed = True
                assert self._pool is not None
                self._pool.poisoned = True
        if not self._end_failed:
            return
        # most runtimes take the stream out of capture when their end fails; one refused
        # before it ran leaves it capturing: the driver ends that (a failed driver end may
        # still end it, so the stream is asked again)
        if rt.is_capturing(side) and not rt.end_capture(side) and rt.is_capturing(side):
            logger.warning(
                "%s: a failed capture could not be ended; this thread's captures move to a "
                "new capture stream (the old one stays capturing).",
                type(self).__name__,
            )
        self.backend.retire_capture_stream(side)

    def _undo_pool(self) -> None:
        """Give back what the runtime took of the pool for a capture it did not complete."""
        pool = self._pool
        assert pool is not None
        undo_pool_capture(self.runtime, pool.id, pool.use_count(), self._base_use)
