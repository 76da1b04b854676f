"""ACL graphs: the device layer's StreamGraph over torch_npu's NPUGraph, plus Ascend's own.

The capture itself (side stream, thread_local mode, the failed-capture undo, the keeper and
poisoned pools) is `xgraph.adapter.StreamGraph`'s. What is Ascend's: while a capture records,
an error translation turns an op's runtime failure into the xgraph error naming the ACL
cause (a VMM call of the shared-physical pool, a 107xxx capture error, 207008 stream
resources); the runtime's refusals of capture_begin / capture_end and replay carry the ACL
error name and advice; and graph task updates (`task_updates`) re-parameterise host-planned
ops before each replay.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch.utils._python_dispatch import TorchDispatchMode

from xgraph.adapter import StreamGraph, XGraphError

from .errors import capture_error, runtime_error, take_vmm_failure, translate_op_error
from .runtime import NpuRuntime
from .taskupdate import TaskUpdates

if TYPE_CHECKING:
    from .backend import AscendBackend


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


class AscendGraph(StreamGraph):
    """One NPUGraph; `_reset` replaces it, so the object can capture again."""

    backend: AscendBackend
    runtime: NpuRuntime

    def __init__(self, backend: AscendBackend) -> None:
        super().__init__(backend)
        self._task_updates: TaskUpdates | None = None

    def capture_error(self, exc: BaseException, call: str) -> XGraphError:
        return capture_error(exc, f"NPUGraph.{call}")

    def replay_error(self, exc: BaseException) -> XGraphError | None:
        return runtime_error(exc, "NPUGraph.replay")

    def recording_context(self) -> AbstractContextManager[Any]:
        take_vmm_failure()  # a VMM failure noted before this capture is not its cause
        return _AclErrors()

    def _reset(self) -> None:
        try:
            super()._reset()
        finally:
            self._task_updates = None

    def task_updates(self) -> TaskUpdates:
        """During capture: this graph's task updates, run before each replay (made once)."""
        if not self.capturing:
            raise XGraphError("task_updates: only a graph being captured takes task updates.")
        if self._task_updates is None:
            backend = self.backend
            self._task_updates = TaskUpdates(
                self.runtime, backend.update_stream(), backend.synchronize, backend.update_lock
            )
            self.add_update(self._task_updates)
        return self._task_updates
