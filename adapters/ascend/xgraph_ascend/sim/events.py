"""Simulated torch.npu.ExternalEvent: what orders a graph task update before its replay.

Captured, `wait` becomes a task that, at replay, needs the event recorded since its last
reset; `reset` clears it. An update ends with `record` on the update stream. A replay whose
update was skipped finds the event unrecorded: on an NPU that replay would wait forever;
here it raises ACL_ERROR_RT_WAIT_TIMEOUT naming the cause, so the skip is detected instead
of running attention on the previous step's lengths.
"""

from __future__ import annotations

import itertools
from typing import Any

from ..errors import AclRuntimeError
from .capture import Task, route_task
from .streams import SimStreams

WAIT_TIMEOUT = 107019
_ids = itertools.count(1)


class SimExternalEvent:
    """An event made with graph_external=True: wait may come before record; reset to reuse."""

    def __init__(self, streams: SimStreams) -> None:
        self._streams = streams
        self.id = next(_ids)
        self.recorded = False

    def wait(self, stream: Any = None) -> None:
        route_task(self._streams, stream, Task("ExternalEventWait", self._wait_now), False)

    def reset(self, stream: Any = None) -> None:
        route_task(self._streams, stream, Task("ExternalEventReset", self._reset_now), False)

    def record(self, stream: Any = None) -> None:
        route_task(self._streams, stream, Task("ExternalEventRecord", self._record_now), False)

    def _wait_now(self) -> None:
        if not self.recorded:
            raise AclRuntimeError(
                WAIT_TIMEOUT,
                "aclmdlRIExecuteAsync",
                f"the graph waits on ExternalEvent #{self.id}, which nothing recorded since its "
                "last reset: the graph task update before this replay was skipped. On an NPU "
                "this replay would block forever; run the update (Graph.replay does) first",
            )

    def _reset_now(self) -> None:
        self.recorded = False

    def _record_now(self) -> None:
        self.recorded = True
