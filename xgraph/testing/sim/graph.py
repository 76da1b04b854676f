"""The simulated torch graph: torch.cuda.CUDAGraph's rules over a recorder of host ops.

- capture_begin(pool, capture_error_mode): refuses an unknown mode, the default stream, a
  stream already capturing and an instance that holds a capture; then, in torch's order,
  routes the thread's allocations to the pool (a use of it), takes the host allocator's
  record of the pool id, and only then begins the runtime's capture, so a begin that fails
  leaves both behind, as torch does.
- capture_end: ends the runtime's capture first and raises on failure before anything else
  (the release branches' order), keeping the pool's use, the thread's routing and the host
  allocator's routing of the id. A failed end takes the stream out of capture all the same
  (ACL: on every failure after its status checks; CUDA: an invalidated capture); only a
  refusal before the end runs (fault "capture_end_refused": torch's "Capture must end on
  the same stream it began on", CUDA's wrong-thread check) leaves the stream capturing, to
  be ended through the driver (`end_capture`). A capture_end that failed must not be called
  again (on torch_npu master that asserts `num_active_captures_ > 0`): the simulator
  records it.
- replay: re-runs the recorded ops; they count as queued on the current stream until it
  synchronizes (the recording's `replayed` says whether its last replay may still run).
- reset: gives back the pool use and the host use of a completed capture, and only of one.
- where the runtime's `refuse_host_reads` is set (CUDA's rule: a synchronising call from
  the capturing thread fails and invalidates the capture), an op that hands the host a
  device value (`SYNCHRONISING_READS`) fails the capture.
- a readable graph (`keep`, made by SimRuntime.readable_graph) describes what it records:
  `launches()` after capture_end (the parameterization check).
The recorder is a TorchDispatchMode of the capturing thread: it records the ops issued on
the capture stream into an OpTape whose fresh tensors land in the pool; ops issued on other
streams run unrecorded.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode,
)

from xgraph.backends.cpu import OpTape
from xgraph.interfaces import Launch

from .caching import PoolId, PrivatePool, graph_pool_id

if TYPE_CHECKING:
    from .runtime import SimRuntime
    from .streams import Queued, SimStream

MODES = ("global", "thread_local", "relaxed")
# ops that wait for the device to give the host a value (SimRuntime.refuse_host_reads)
SYNCHRONISING_READS = frozenset(
    ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::equal")
)


def leave_recorder(recorder: TorchDispatchMode) -> None:
    """Take a capture's recorder off this thread's dispatch stack, where it must be on top."""
    if _get_current_dispatch_mode() is not recorder:
        raise RuntimeError(
            "simulated capture end: another TorchDispatchMode is still active above the "
            "capture's recorder; modes entered during a capture must be left before it ends"
        )
    recorder.__exit__(None, None, None)


class SimRecorder(TorchDispatchMode):
    """One capture's recording; entered in the capturing thread by `start`."""

    def __init__(self, runtime: SimRuntime, stream: SimStream, pool: PrivatePool) -> None:
        super().__init__()
        self.runtime, self.stream = runtime, stream
        self.thread = threading.get_ident()
        self.tape = OpTape()
        self.tape.begin(pool.cache)
        self.keep_launches = self.tape.keep_launches
        self.attached = False  # its dispatch mode is on the capturing thread's stack
        self.invalid: int = 0  # the code that invalidated the capture, if any
        self.replayed: Queued | None = None  # its last replay (it may still run)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self.runtime.refuse_host_reads and func._schema.name in SYNCHRONISING_READS:
            self.invalid = self.runtime.STREAM_CAPTURED  # as CUDA invalidates the capture
            raise self.runtime.error(
                self.invalid, str(func), "a synchronising host read while the stream captures"
            )
        out = func(*args, **kwargs)
        if self.runtime.streams.current() is not self.stream:
            return out  # another stream: runs, is not recorded
        return self.tape.record(func, args, kwargs, out)

    def start(self) -> None:
        self.__enter__()
        self.attached = True
        self.stream.capture = self

    def detach(self) -> None:
        """Leave the capturing thread (the stream may go on capturing, recording nothing)."""
        if self.attached:
            leave_recorder(self)
            self.attached = False

    def stop(self) -> int:
        """End the capture on its stream; 0, or the code that invalidated it."""
        self.detach()
        self.stream.capture = None
        with _disable_current_modes():  # sealing builds tensors: not recorded
            self.tape.seal()
        return self.invalid

    def replay(self) -> None:
        self.tape.replay()

    def launches(self) -> list[Launch]:
        return self.tape.launches()

    def drop(self) -> None:
        self.tape.clear()


class SimGraph:
    """One torch graph instance (see the module docstring for its rules)."""

    BEGIN, END, REPLAY = "capture_begin", "capture_end", "replay"  # fault names of the calls
    END_REFUSED = "capture_end_refused"  # a refusal before the end runs (see the docstring)

    def __init__(self, runtime: SimRuntime) -> None:
        self._rt = runtime
        self._recording: Any = None
        self._pool_id: PoolId | None = None
        self._state = "empty"  # -> "capturing" -> "captured" -> (reset) "empty"
        self._end_failed = False
        self.keep = False  # a readable graph (SimRuntime.readable_graph): launches() answers

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        rt = self._rt
        if capture_error_mode not in MODES:
            raise RuntimeError(f"Unknown capture_error_mode {capture_error_mode!r}; use {MODES}")
        if self._state != "empty":
            raise RuntimeError(
                "This graph instance already owns a captured graph or a capture. To capture "
                "a new graph, create a new instance (or reset() this one)."
            )
        stream = rt.streams.current()
        if stream.is_default:
            raise RuntimeError("Graphs must be captured on a non-default stream.")
        if stream.capture is not None:
            raise rt.error(rt.STREAM_CAPTURED, self.BEGIN, "the stream is already capturing")
        given = tuple(pool) if pool is not None else (0, 0)
        pool_id: PoolId = (given[0], given[1]) if given != (0, 0) else graph_pool_id()
        private = rt.caching.begin_allocate_to_pool(pool_id)
        self._pool_id = pool_id
        rt.caching.host_begin(pool_id)
        rt.check_fault(self.BEGIN)
        self._recording = self._recorder(stream, private, capture_error_mode)
        if self.keep:
            self._recording.keep_launches()
        self._recording.start()
        self._state = "capturing"

    def _recorder(self, stream: SimStream, pool: PrivatePool, mode: str) -> Any:
        return SimRecorder(self._rt, stream, pool)

    def _end_recording(self) -> int:
        """End the runtime's capture: 0, or the code it failed with. A failed end still
        takes the stream out of capture (what it recorded is dropped), as ACL and CUDA do
        once their end runs."""
        code = self._rt.faults.check(self.END)
        stopped = int(self._recording.stop())
        return code or stopped

    def _end_error(self, code: int) -> Exception:
        return self._rt.error(code, self.END, "the capture could not be ended")

    def capture_end(self) -> None:
        rt = self._rt
        if self._state != "capturing":
            raise RuntimeError("capture_end: this graph is not capturing")
        if self._end_failed:
            rt.violation("capture_end was called again after it failed on the same capture")
            raise RuntimeError("capture_end: this capture's end already failed")
        refused = rt.faults.check(self.END_REFUSED)
        if refused:  # before the runtime's end ran: the stream keeps capturing
            self._end_failed = True
            raise rt.error(refused, self.END, "refused before the capture was ended")
        code = self._end_recording()
        if code:
            self._end_failed = True
            raise self._end_error(code)
        assert self._pool_id is not None
        rt.caching.end_allocate_to_pool(self._pool_id)
        rt.caching.host_end(self._pool_id)
        self._state = "captured"

    def replay(self) -> None:
        rt = self._rt
        if self._state != "captured":
            raise RuntimeError("replay: this graph holds no completed capture")
        rt.check_fault(self.REPLAY)
        try:
            self._recording.replay()
        finally:
            self._recording.replayed = rt.mark_busy()  # its work may run until a synchronize

    def _destroy(self) -> None:
        """Give back what the runtime made for a completed capture (nothing here)."""

    def _recording_on(self) -> bool:
        """Whether this graph's capture still records (reset must wait for its end)."""
        return self._recording is not None and self._recording.attached

    def reset(self) -> None:
        rec, state = self._recording, self._state
        if state == "capturing" and self._recording_on():
            raise RuntimeError("reset() during its capture: end the capture first")
        if state == "captured":
            assert self._pool_id is not None
            self._destroy()
            self._rt.caching.release_pool(self._pool_id)
            self._rt.caching.host_release(self._pool_id)
        if rec is not None:
            rec.drop()
        self._recording, self._state, self._end_failed = None, "empty", False

    def launches(self) -> list[Launch]:
        """What the completed capture records (a readable graph's only)."""
        if self._state != "captured" or not self.keep:
            raise RuntimeError("launches: this graph holds no completed readable capture")
        return self._recording.launches()

    def pool(self) -> PoolId:
        if self._state != "captured" or self._pool_id is None:
            raise RuntimeError("pool: this graph holds no completed capture")
        return self._pool_id
