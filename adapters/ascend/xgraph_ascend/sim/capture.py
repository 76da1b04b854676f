"""One simulated stream capture: the recorded program, task groups and their updates.

A capture records what its thread issues on the capture stream: aten ops through a
TorchDispatchMode into the CPU backend's OpTape (fresh tensors land in the capture pool),
and device tasks (kernels of the simulated torch_npu, ExternalEvent waits, resets and
records) as Task items between tape segments. Replay runs the program in order.

Rules kept here (CANN "single-stream capture" rules): an op on the default stream while
capturing invalidates the capture (107031); an end from another thread than the begin's
returns 107038 and takes the stream out of capture (hicann/runtime capture_model_utils.cc,
context_aclgraph.cc), as every failed end does; a task group must open and close on a capturing
stream, not nested (107029 / 107033); a graph task update must re-issue, on a stream that is
not capturing, exactly the group's tasks in count and kernel type, and it replaces their
parameters. A mismatch fails as the runtime reports it: RT_ERROR_STREAM_TASKGRP_UPDATE
("task group update error") for a count, RT_ERROR_KERNEL_TYPE ("kernel type error") for a
type, both surfacing as 507000 ACL_ERROR_RT_INTERNAL_ERROR (hicann/runtime
context_aclgraph.cc, aix_stars.cc, errcode_manage.cc). 207019 is something else: a driver
that cannot update the op at all.

A capture kept readable (`keep_launches`, the parameterization check) describes its task
list: each op, each task with its arguments, and whether a task group's update re-issues it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
)

from xgraph.adapter import Launch
from xgraph.testing.sim import OpTape, current_layer, describe, leave_recorder

from ..errors import AclRuntimeError

if TYPE_CHECKING:
    from xgraph.testing.sim import Queued

    from .caching import PrivatePool
    from .streams import SimStream, SimStreams

STREAM_NOT_CAPTURED = 107029
CAPTURE_IMPLICIT = 107031
TASK_GROUP_STATUS = 107033
WRONG_THREAD = 107038  # ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD
INTERNAL_ERROR = 507000  # what a task update that does not match its group fails with


@dataclass
class Task:
    """A device task: a kernel (parameters replaceable by update) or an event operation."""

    kind: str
    fn: Callable[..., None] | None  # None: an aten op inside a task group (counted only)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def run(self) -> None:
        if self.fn is None:
            return
        # a kernel is opaque to dispatch modes, like a device kernel to torch
        with _disable_current_modes(), torch.no_grad():
            self.fn(*self.args, **self.kwargs)


@dataclass(eq=False)
class TaskGroupHandle:
    """What graph_task_group_end returns: the group's tasks inside one capture."""

    capture: SimCapture
    tasks: list[Task]


@dataclass(eq=False)
class UpdateSession:
    """An update in progress on a stream: the tasks it re-issues, checked at its end."""

    handle: TaskGroupHandle
    issued: list[Task] = field(default_factory=list)

    def finish(self) -> None:
        want = [t.kind for t in self.handle.tasks]
        got = [t.kind for t in self.issued]
        if len(want) != len(got):
            why = f"task group update error: the update issued {len(got)} task(s) {got}"
        elif want != got:
            why = f"kernel type error: the update issued {got}"
        else:
            why = ""
        if why:
            raise AclRuntimeError(
                INTERNAL_ERROR,
                "aclmdlRICaptureTaskUpdateEnd",
                f"{why}, the task group holds {want}: an update must re-issue the group's "
                "tasks, same count and kernel type",
            )
        for old, new in zip(self.handle.tasks, self.issued):
            old.args, old.kwargs = new.args, new.kwargs


class SimCapture(TorchDispatchMode):
    """The recorder of one capture; entered in the capturing thread, exited by its end."""

    def __init__(self, streams: SimStreams, stream: SimStream, pool: PrivatePool, mode: str):
        super().__init__()
        self.streams, self.stream, self.pool, self.mode = streams, stream, pool, mode
        self.thread = threading.get_ident()
        self.program: list[OpTape | Task] = []
        self._described: dict[int, Launch] | None = None  # tasks, kept by keep_launches
        self.tape = self._new_tape()
        self.group: list[Task] | None = None
        self.invalid: tuple[int, str] | None = None
        self.state = "capturing"  # -> "captured" | "failed" -> "reset"
        self.replayed: Queued | None = None  # its last replay (it may still run)
        self.attached = False  # on the capturing thread's dispatch stack

    def _new_tape(self) -> OpTape:
        tape = OpTape()
        tape.begin(self.pool.cache)
        if self._described is not None:
            tape.keep_launches()
        return tape

    def keep_launches(self) -> None:
        """Describe what this capture records (`launches`): ops, and tasks with their args."""
        self._described = {}
        self.tape.keep_launches()

    def launches(self) -> list[Launch]:
        """The task list in order: each tape's ops, each task (a task group's: `updated`)."""
        described = self._described or {}
        out: list[Launch] = []
        for item in self.program:
            if isinstance(item, Task):
                out.append(described[id(item)])
            else:
                out += item.launches()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.stream.capture is not self:
            return out  # taken out of capture (an end from another thread): runs, not recorded
        current = self.streams.current()
        if current is not self.stream:
            if current.is_default:
                self.invalidate(CAPTURE_IMPLICIT, f"{func} ran on the default stream")
            return out  # another stream: runs, not recorded
        out = self.tape.record(func, args, kwargs, out)
        if self.group is not None:
            self.group.append(Task(func._schema.name, None))
        return out

    def invalidate(self, code: int, why: str) -> None:
        if self.invalid is None:
            self.invalid = (code, why)

    def _seal(self) -> None:
        # sealing builds tensors with aten ops: they must not be recorded (or guarded)
        with _disable_current_modes():
            self.tape.seal()

    def add_task(self, task: Task) -> None:
        """Append a device task between two tape segments (and to the open group)."""
        self._seal()
        self.program += [self.tape, task]
        self.tape = self._new_tape()
        if self._described is not None:
            config = tuple((f"arg {i}", describe(a)) for i, a in enumerate(task.args))
            config += tuple((k, describe(v)) for k, v in task.kwargs.items())
            updated = self.group is not None  # a task group is re-issued by its update
            self._described[id(task)] = Launch("task", task.kind, config, current_layer(), updated)
        if self.group is not None:
            self.group.append(task)

    def start(self) -> None:
        self.__enter__()
        self.attached = True
        self.stream.capture = self

    def detach(self) -> None:
        """Leave the capturing thread's dispatch stack (only that thread can); idempotent."""
        if self.attached and threading.get_ident() == self.thread:
            leave_recorder(self)
            self.attached = False

    def abandon(self) -> None:
        """Take the stream out of capture, dropping what it recorded (a failed end, from any
        thread: ACL ends the capture and destroys its model on every failure after its
        status checks). The capturing thread leaves the recorder at its own next end."""
        if self.stream.capture is self:
            self.stream.capture = None
        self.state = "failed"
        self.detach()

    def stop(self) -> int:
        """End the capture; 0 or the code that invalidated it. From another thread than the
        one that began it: 107038, and the stream leaves capture all the same."""
        if threading.get_ident() != self.thread:
            self.abandon()
            return WRONG_THREAD
        self.detach()
        self.stream.capture = None
        self._seal()
        self.program.append(self.tape)
        if self.group is not None:
            self.invalidate(TASK_GROUP_STATUS, "a task group was left open")
        self.state = "failed" if self.invalid else "captured"
        return self.invalid[0] if self.invalid else 0

    def replay(self) -> None:
        """aclmdlRIExecuteAsync: the program runs on the current stream (up to a wait that
        cannot pass: the stream blocks there, see `run_on`)."""
        run_on(self.streams.current(), self.program)

    def drop(self) -> None:
        self.detach()
        self.state = "reset"
        for item in self.program:
            if isinstance(item, OpTape):
                item.clear()
        self.program = []


class StreamBlocked(Exception):
    """Raised by a task that cannot run yet: a wait on an ExternalEvent nothing recorded."""

    def __init__(self, event: Any) -> None:
        super().__init__(f"a wait on ExternalEvent #{event.id}")
        self.event = event


@dataclass(eq=False)
class Waiting:
    """A blocked stream: the event its wait needs, and the work queued behind the wait."""

    event: Any
    rest: list[OpTape | Task]


def run_on(stream: Any, items: list[OpTape | Task]) -> None:
    """Run program items in order on `stream`, as the NPU runs a stream's tasks: at a wait
    that cannot pass the stream blocks, and the rest (and any task or replay issued on the
    stream later) runs once the event is recorded (SimExternalEvent.record). Eager aten ops
    issued on a blocked stream run at once here: the simulator has no queue for them."""
    if stream.waiting is not None:
        stream.waiting.rest.extend(items)
        return
    with torch.no_grad():
        for i, item in enumerate(items):
            try:
                item.run() if isinstance(item, Task) else item.replay()
            except StreamBlocked as blocked:
                stream.waiting = Waiting(blocked.event, list(items[i + 1 :]))
                blocked.event.waiters.append(stream)
                return


def route_task(streams: SimStreams, stream: Any, task: Task, run_at_capture: bool) -> None:
    """Issue a device task on `stream` (None: current): record it, collect it for an update,
    or run it now (behind a wait its stream is blocked on)."""
    s = stream if stream is not None else streams.current()
    if s.capture is not None:
        s.capture.add_task(task)
        if run_at_capture:
            task.run()  # like the tape, a capture computes real values once
    elif s.update is not None:
        s.update.issued.append(task)
    else:
        run_on(s, [task])
