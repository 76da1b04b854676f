"""Graph task updates: host-planned ops in a captured graph, re-parameterised before replay.

Capture side (per op): `event.wait(s); event.reset(s)` become graph nodes, then the op is
launched inside `graph_task_group_begin(s) ... graph_task_group_end(s)`, which returns the
group's handle. Replay side (before every replay, all ops of the graph): synchronize (the
backend's: this thread's stream while another thread captures, where a device-wide
synchronize would fail), so the previous replay has finished reading the old parameters;
then, on the update stream, `graph_task_update_begin(u, handle)`, the same op with this
step's host values, `graph_task_update_end(u)`, `event.record(u)`: the graph's captured
wait holds the op until its update is in. The backend has one update stream and one lock:
a graph's whole update sequence holds it, so threads replaying at once take turns (ACL
takes one update at a time on a stream, and rules out concurrent updates from several
threads or streams). An update that never runs leaves the wait unreleased (a hang on an
NPU), never a silent stale launch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from xgraph.adapter import XGraphError

from .errors import acl_code, advice, error_name
from .runtime import NpuRuntime

logger = logging.getLogger("xgraph")

Launch = Callable[[Any], None]  # launches the op with the given host parameters


@dataclass
class _Update:
    handle: Any
    event: Any
    launch: Launch
    params: Callable[[], Any]  # this step's host parameters, read before each replay


class TaskUpdates:
    """The task-updated ops of one captured graph; called before each replay."""

    def __init__(
        self,
        runtime: NpuRuntime,
        update_stream: Any,
        synchronize: Callable[[], None],
        lock: AbstractContextManager[Any],
    ) -> None:
        self.runtime = runtime
        self.update_stream = update_stream
        self.synchronize = synchronize  # the backend's: never a device-wide call that fails
        self.lock = lock  # the update stream's: one thread's update sequence at a time
        self.items: list[_Update] = []

    def record(self, launch: Launch, params: Callable[[], Any]) -> None:
        """During capture, on the capture stream: launch the op as an updatable task group."""
        rt = self.runtime
        stream = rt.current_stream()
        event = rt.external_event()
        event.wait(stream)
        event.reset(stream)
        rt.task_group_begin(stream)
        launch(params())
        handle = rt.task_group_end(stream)
        self.items.append(_Update(handle, event, launch, params))

    def __call__(self) -> None:
        """Before a replay: re-launch every op with this step's parameters."""
        rt, u = self.runtime, self.update_stream
        self.synchronize()  # the previous replay must be done with the parameters we replace
        try:
            with self.lock, rt.use_stream(u):
                for item in self.items:
                    self._apply(u, item)
        except XGraphError:
            raise
        except Exception as exc:
            raise _update_error(exc) from exc

    def _apply(self, u: Any, item: _Update) -> None:
        rt = self.runtime
        rt.task_update_begin(u, item.handle)
        try:
            item.launch(item.params())
        except BaseException:
            with contextlib.suppress(Exception):  # close the update; the launch's error wins
                rt.task_update_end(u)
            raise
        rt.task_update_end(u)
        item.event.record(u)


def _update_error(exc: Exception) -> XGraphError:
    code = acl_code(exc)
    name = f"{error_name(code)} ({code}): " if code is not None else ""
    return XGraphError(
        f"Graph task update before replay failed: {name}{exc}. "
        f"{advice(code) if code is not None else ''} The graph was not replayed; run the step "
        "eagerly or capture it again."
    )
