"""Simulated torch.npu.ExternalEvent: what orders a graph task update before its replay.

Captured, `wait` becomes a task that, at replay, needs the event recorded since its last
reset; `reset` clears it. An update ends with `record` on the update stream. A replay whose
update was skipped finds the event unrecorded, and does what an NPU does: the replay returns
(aclmdlRIExecuteAsync is asynchronous) and its stream blocks at the wait, so nothing of the
graph after it runs and later work on that stream queues behind it (capture.run_on). A
record releases it: the rest runs then. Where an NPU's synchronize of the blocked stream (or
of the device) would hang, or time out with a timeout set, the simulator's fails at once
with ACL_ERROR_RT_STREAM_SYNC_TIMEOUT naming the wait (SimRuntime.synchronize), so a test
sees the skip instead of hanging, and the graph never runs attention on stale lengths.
"""

from __future__ import annotations

import itertools
from typing import Any

from .capture import StreamBlocked, Task, route_task, run_on
from .streams import SimStreams

_ids = itertools.count(1)


class SimExternalEvent:
    """An event made with graph_external=True: wait may come before record; reset to reuse."""

    def __init__(self, streams: SimStreams) -> None:
        self._streams = streams
        self.id = next(_ids)
        self.recorded = False
        self.waiters: list[Any] = []  # streams blocked on a wait for this event

    def wait(self, stream: Any = None) -> None:
        route_task(self._streams, stream, Task("ExternalEventWait", self._wait_now), False)

    def reset(self, stream: Any = None) -> None:
        route_task(self._streams, stream, Task("ExternalEventReset", self._reset_now), False)

    def record(self, stream: Any = None) -> None:
        route_task(self._streams, stream, Task("ExternalEventRecord", self._record_now), False)

    def _wait_now(self) -> None:
        if not self.recorded:
            raise StreamBlocked(self)

    def _reset_now(self) -> None:
        self.recorded = False

    def _record_now(self) -> None:
        self.recorded = True
        waiters, self.waiters = self.waiters, []
        for stream in waiters:  # each runs what queued behind its wait
            waiting = stream.waiting
            if waiting is not None and waiting.event is self:
                stream.waiting = None
                run_on(stream, waiting.rest)
