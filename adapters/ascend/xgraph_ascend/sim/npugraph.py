"""Simulated torch.npu.NPUGraph: the core simulator's graph rules over ACL calls.

The state rules, routing order, pool and host-allocator uses are `xgraph.testing.sim`'s
SimGraph (torch_npu's release branches keep torch's order: routing before the ACL capture
begins, an ACL failure at the end raised before the routing ends). What is ACL's here: the
recorder is a SimCapture (task groups, default-stream rules); the capture ends through the
simulated aclmdlRICaptureEnd, which returns a model RI, and which takes the stream out of
capture when it fails (no model then); a replay is aclmdlRIExecuteAsync;
a reset destroys the model RI of a completed capture.
"""

from __future__ import annotations

import ctypes
from typing import Any

from xgraph.testing.sim import SimGraph

from ..errors import AclRuntimeError
from .capture import SimCapture


class SimNPUGraph(SimGraph):
    """One NPUGraph instance (see the module docstring for its rules)."""

    BEGIN, REPLAY = "aclmdlRICaptureBegin", "aclmdlRIExecuteAsync"

    def __init__(self, runtime: Any) -> None:  # a SimRuntime (which imports this module)
        super().__init__(runtime)
        self._ri: int | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self._rt.streams.current().is_default:
            raise RuntimeError(
                "NPU graphs must be captured on a non-default stream. (However, after capture, "
                "it's ok to replay them on the default stream.)"
            )
        super().capture_begin(pool, capture_error_mode)

    def _recorder(self, stream: Any, pool: Any, mode: str) -> SimCapture:
        return SimCapture(self._rt.streams, stream, pool, mode)

    def _end_recording(self) -> int:
        ri = ctypes.c_void_p()
        rc = self._rt.acl.aclmdlRICaptureEnd(self._recording.stream.handle, ctypes.byref(ri))
        self._ri = int(ri.value or 0) if not rc else None
        self._recording.detach()  # ended, or taken out of capture before (another thread)
        return int(rc)

    def _recording_on(self) -> bool:
        rec = self._recording
        return rec is not None and rec.stream.capture is rec

    def _end_error(self, code: int) -> Exception:
        return AclRuntimeError(code, "aclmdlRICaptureEnd", self._rt.acl.recent_error())

    def _destroy(self) -> None:
        if self._ri is not None:
            self._rt.acl.aclmdlRIDestroy(self._ri)
            self._ri = None
