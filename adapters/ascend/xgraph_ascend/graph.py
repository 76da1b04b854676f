"""ACL graphs: CheckedGraph's four driver calls over torch_npu's NPUGraph on a side stream.

`_begin` synchronizes (as torch.npu.graph does; its empty_cache and host_empty_cache are
skipped: they would drop other pools' cached segments), moves the thread to the backend's
capture stream (NPU graphs refuse the default stream) and begins the capture on the pool in
thread_local mode. While it records, an error translation turns an op's runtime failure
into the xgraph error naming the ACL cause (a VMM call of the shared-physical pool, a
107xxx capture error, 207008 stream resources). `_reset` copes with whatever a failed
capture left: it ends a capture torch_npu could not end (through aclmdlRICaptureEnd and
aclmdlRIDestroy), undoes the pool's routing and use, and restores the streams. State
machine, pool checks, routing and the capture-safety guard are CheckedGraph's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Any, Protocol

from torch.utils._python_dispatch import TorchDispatchMode

from xgraph.errors import XGraphError
from xgraph.graphs import CheckedGraph
from xgraph.interfaces import CapturePool

from .errors import capture_error, runtime_error, take_vmm_failure, translate_op_error
from .pool import AscendCapturePool
from .runtime import NpuRuntime
from .taskupdate import TaskUpdates

logger = logging.getLogger("xgraph")


class _Streams(Protocol):
    runtime: NpuRuntime

    def capture_stream(self) -> Any: ...
    def update_stream(self) -> Any: ...


class _AclErrors(TorchDispatchMode):
    """During capture: an op's runtime error becomes the xgraph error naming its ACL cause."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        try:
            return func(*args, **(kwargs or {}))
        except XGraphError:
            raise
        except RuntimeError as exc:
            err = translate_op_error(exc, func)
            if err is None:
                raise
            raise err from exc


class AscendGraph(CheckedGraph):
    """One NPUGraph; `_reset` replaces it, so the object can capture again."""

    pool_type = AscendCapturePool
    backend: _Streams

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self.runtime: NpuRuntime = backend.runtime
        self._g = self.runtime.new_graph()
        self._pool: AscendCapturePool | None = None
        self._base_use = 0  # the pool's use count before this capture began
        self._begun = False  # NPUGraph.capture_begin succeeded, capture_end did not
        self._captured = False
        self._side: Any = None
        self._streams: contextlib.ExitStack | None = None
        self._errors: contextlib.ExitStack | None = None
        self._task_updates: TaskUpdates | None = None

    def _begin(self, pool: CapturePool) -> None:
        assert isinstance(pool, AscendCapturePool)  # CheckedGraph checked pool_type
        rt = self.runtime
        if pool.runtime is not rt:
            raise XGraphError("capture_begin: the pool belongs to another NPU runtime.")
        rt.synchronize()
        streams = self._streams = contextlib.ExitStack()
        origin = rt.current_stream()
        side = self._side = self.backend.capture_stream()
        side.wait_stream(origin)
        # runs last on exit, once the stream is restored: later work sees the capture's
        streams.callback(origin.wait_stream, side)
        streams.enter_context(rt.use_stream(side))
        self._pool, self._base_use = pool, pool.use_count()
        take_vmm_failure()  # a VMM failure noted before this capture is not its cause
        try:
            self._g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        except Exception as exc:
            raise capture_error(exc, "NPUGraph.capture_begin") from exc
        self._begun = True
        errors = self._errors = contextlib.ExitStack()
        errors.enter_context(_AclErrors())

    def _end(self) -> None:
        self._leave(self._errors)
        self._errors = None
        try:
            self._g.capture_end()
        except Exception as exc:
            raise capture_error(exc, "NPUGraph.capture_end") from exc
        self._begun, self._captured = False, True
        self._leave(self._streams)
        self._streams = None

    def _replay(self) -> None:
        try:
            self._g.replay()
        except Exception as exc:
            raise runtime_error(exc, "NPUGraph.replay") from exc

    def _reset(self) -> None:
        failed = self._pool is not None and not self._captured
        try:
            self._leave(self._errors)
            if failed and self._begun:
                self._end_failed_capture()
            self._leave(self._streams)
            self._reset_npu_graph(quiet=failed)
            if failed:
                self._undo_pool()
        finally:
            # a fresh NPUGraph: torch_npu refuses a second capture on an instance that had one
            self._g = self.runtime.new_graph()
            self._errors = self._streams = None
            self._pool, self._side, self._task_updates = None, None, None
            self._begun = self._captured = False

    def task_updates(self) -> TaskUpdates:
        """During capture: this graph's task updates, run before each replay (made once)."""
        if not self.capturing:
            raise XGraphError("task_updates: only a graph being captured takes task updates.")
        if self._task_updates is None:
            self._task_updates = TaskUpdates(self.runtime, self.backend.update_stream())
            self.add_update(self._task_updates)
        return self._task_updates

    # -- after a failed capture ------------------------------------------------------------

    @staticmethod
    def _leave(stack: contextlib.ExitStack | None) -> None:
        if stack is not None:
            stack.close()

    def _reset_npu_graph(self, quiet: bool) -> None:
        try:
            self._g.reset()
        except Exception:
            if not quiet:
                raise
            logger.debug("NPUGraph.reset after a failed capture failed", exc_info=True)

    def _end_failed_capture(self) -> None:
        """End torch_npu's capture on the side stream; if it cannot, end it through ACL."""
        rt, side = self.runtime, self._side
        try:
            self._g.capture_end()
        except Exception:
            logger.debug("NPUGraph.capture_end after a failed capture failed", exc_info=True)
        self._begun = False
        if side is None or not rt.is_capturing(side):
            return
        if not rt.acl.has("aclmdlRICaptureEnd", "aclmdlRIDestroy"):
            logger.warning(
                "AscendGraph: a failed capture is still on; libascendcl lacks "
                "aclmdlRICaptureEnd to end it. Use a new capture stream."
            )
            return
        ri = ctypes.c_void_p()
        rc = rt.acl.aclmdlRICaptureEnd(rt.stream_handle(side), ctypes.byref(ri))
        if ri.value:
            rt.acl.aclmdlRIDestroy(ri.value)
        if rc:
            logger.warning(
                "AscendGraph: could not end a failed capture (aclmdlRICaptureEnd: %s %s); the "
                "capture stream may be unusable.",
                rc,
                rt.acl.recent_error(),
            )

    def _undo_pool(self) -> None:
        """Undo torch_npu's routing of this thread to the pool and the capture's pool use."""
        pool, rt = self._pool, self.runtime
        assert pool is not None
        rt.end_allocate_to_pool(pool.id)
        try:
            for _ in range(pool.use_count() - max(self._base_use, 1)):
                rt.release_pool(pool.id)
        except Exception:
            logger.exception("AscendGraph: releasing pool %s after a failed capture", pool.id)
