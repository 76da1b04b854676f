"""Simulated torch.npu.NPUGraph: the state rules of torch_npu's graph over a SimCapture.

- capture_begin(pool, capture_error_mode): a known mode; refuses the default stream, a
  stream already capturing, and an instance that holds a capture (reset it, or make a new
  one); routes the thread's allocations to the pool first, then begins the ACL capture, as
  torch_npu does (so a failed begin leaves the routing for the caller to undo).
- capture_end: ends the ACL capture through the simulated aclmdlRICaptureEnd; on failure it
  raises before ending the routing (the release branches' order) and keeps the pool's use.
- replay: aclmdlRIExecuteAsync: runs the program; the device counts as busy until the next
  synchronize (an unmap or a task update before it is a violation the books record).
- reset: releases the pool's use and destroys the model RI of a completed capture.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..errors import AclRuntimeError
from .capture import SimCapture

MODES = ("global", "thread_local", "relaxed")
STREAM_CAPTURED = 107027


class SimNPUGraph:
    """One NPUGraph instance (see the module docstring for its rules)."""

    def __init__(self, runtime: Any) -> None:  # a SimRuntime (which imports this module)
        self._rt = runtime
        self._capture: SimCapture | None = None
        self._pool_id: tuple[int, int] | None = None
        self._ri: int | None = None
        self._state = "empty"  # -> "capturing" -> "captured" -> (reset) "empty"

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        rt = self._rt
        if capture_error_mode not in MODES:
            raise RuntimeError(f"Unknown capture_error_mode {capture_error_mode!r}; use {MODES}")
        if self._state != "empty":
            raise RuntimeError(
                "This NPUGraph instance already owns a captured graph or a capture. To capture "
                "a new graph, create a new instance (or reset() this one)."
            )
        stream = rt.streams.current()
        if stream.is_default:
            raise RuntimeError(
                "NPU graphs must be captured on a non-default stream. (However, after capture, "
                "it's ok to replay them on the default stream.)"
            )
        if stream.capture is not None:
            raise AclRuntimeError(STREAM_CAPTURED, "aclmdlRICaptureBegin", "already capturing")
        pool_id = tuple(pool) if pool is not None and tuple(pool) != (0, 0) else rt.private_id()
        private = rt.caching.begin_allocate_to_pool(pool_id)  # type: ignore[arg-type]
        self._pool_id = pool_id  # type: ignore[assignment]
        code = rt.faults.check("aclmdlRICaptureBegin")
        if code:
            raise AclRuntimeError(code, "aclmdlRICaptureBegin", "injected failure")
        capture = SimCapture(rt.streams, stream, private, capture_error_mode)
        capture.start()
        self._capture, self._state = capture, "capturing"

    def capture_end(self) -> None:
        if self._state != "capturing" or self._capture is None:
            raise RuntimeError("capture_end: this NPUGraph is not capturing")
        rt = self._rt
        ri = ctypes.c_void_p()
        rc = rt.acl.aclmdlRICaptureEnd(self._capture.stream.handle, ctypes.byref(ri))
        if rc:
            raise AclRuntimeError(rc, "aclmdlRICaptureEnd", rt.acl.recent_error())
        assert self._pool_id is not None
        rt.caching.end_allocate_to_pool(self._pool_id)
        self._ri, self._state = int(ri.value or 0), "captured"

    def replay(self) -> None:
        if self._state != "captured" or self._capture is None:
            raise RuntimeError("replay: this NPUGraph holds no completed capture")
        rt = self._rt
        code = rt.faults.check("aclmdlRIExecuteAsync")
        if code:
            raise AclRuntimeError(code, "aclmdlRIExecuteAsync", "injected failure")
        try:
            self._capture.replay()
        finally:
            rt.mark_busy()

    def reset(self) -> None:
        capture, state = self._capture, self._state
        if state == "capturing" and capture is not None and capture.stream.capture is capture:
            raise RuntimeError("NPUGraph.reset() during its capture: end the capture first")
        if state == "captured":
            assert self._pool_id is not None and self._ri is not None
            rt = self._rt
            rt.acl.aclmdlRIDestroy(self._ri)
            rt.caching.release_pool(self._pool_id)
        if capture is not None:
            capture.drop()
        self._capture, self._ri, self._state = None, None, "empty"

    def pool(self) -> tuple[int, int]:
        if self._pool_id is None:
            raise RuntimeError("pool: this NPUGraph has not begun a capture")
        return self._pool_id
