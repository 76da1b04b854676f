"""CheckedGraph: the Graph contract's state machine and capture safety, once for every backend.

An adapter writes four driver calls (`_begin`, `_end`, `_replay`, `_reset`; see
xgraph.interfaces.Graph). This class checks every call against the state machine
(idle -> capturing -> captured -> reset -> idle) and the pool (its type, not closed, open
for each replay), enters the pool's segment routing around the capture, and runs the
capture-safety guard: one TorchDispatchMode that refuses host reads of device data before
they run (`xgraph.safety.check_op`, plus any per-capture check such as the piecewise
bypass check), and the per-thread block on Tensor.tolist / numpy. A capture that fails in
any way, KeyboardInterrupt included, is undone through `_reset`.

`graph(g)` is the public context manager for capturing one callable outside an executor,
in the style of `torch.cuda.graph`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import IncompleteBackendError, PoolClosedError, XGraphError
from .interfaces import Backend, CapturePool, Graph, Launch, OpCheck
from .regions import refuse_capture_inside
from .safety import block_host_conversions, check_op

logger = logging.getLogger("xgraph")

_IDLE, _CAPTURING, _CAPTURED = "idle", "capturing", "captured"

_local = threading.local()


def capturing_graph() -> CheckedGraph | None:
    """The graph this thread is capturing now, if any (runners register updates on it)."""
    return getattr(_local, "graph", None)


# captures of xgraph's open at the driver in every thread: a synchronize or an unmap on
# any thread breaks a capture where the driver captures in its global mode
_open = 0
_open_lock = threading.Lock()


def recording_here() -> bool:
    """Whether a capture of this thread is open at the driver: from before its begin to
    after its end or reset, longer than `capturing_graph()` (a synchronize or an unmap in
    that window breaks the capture; a finalizer that frees memory must wait)."""
    return getattr(_local, "recording", 0) > 0


def recording_anywhere() -> bool:
    """Whether a capture of xgraph's is open at the driver on any thread (as
    `recording_here`, for every thread)."""
    return _open > 0


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    global _open
    _local.recording = getattr(_local, "recording", 0) + 1
    with _open_lock:
        _open += 1
    try:
        yield
    finally:
        with _open_lock:
            _open -= 1
        _local.recording -= 1


class _CaptureGuard(TorchDispatchMode):
    """Checks each op before it runs; lets the graph's driver see it after (host recorders)."""

    compiler_disabled = False  # set by _disable_compiler_once: Dynamo skips the guard

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ to keep Dynamo out, a wrapper every op pays;
        # _disable_compiler_once keeps it out by the code's strategy instead
        return False

    def __init__(self, graph: CheckedGraph, op_check: OpCheck | None) -> None:
        super().__init__()
        self.graph = graph
        self.device = graph.backend.device
        self.op_check = op_check
        _disable_compiler_once()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        check_op(func, args, kwargs, self.device)
        if self.op_check is not None:
            self.op_check(func, args, kwargs)
        return self.graph._record_op(func, args, kwargs, func(*args, **kwargs))


def _disable_compiler_once() -> None:
    """The guard is library code: a compiled forward never traces it. Dynamo is told to skip
    its frame and every frame it calls (a code-object strategy: no wrapper, so no cost per
    op; re-set for every guard, since torch._dynamo.reset() may clear it). Where that call
    is missing, torch.compiler.disable wraps the method instead (about 10 us an op). Either
    imports torch._dynamo (about a second), so it happens when the first guard is built,
    not when xgraph is imported."""
    global _skip
    if _skip is None:
        _skip = _frame_skipper()
    _skip()


_skip: Callable[[], None] | None = None


def _frame_skipper() -> Callable[[], None]:
    code = _CaptureGuard.__torch_dispatch__.__code__
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        set_code_exec_strategy(code, strategy)
    except (ImportError, AttributeError, TypeError):
        _CaptureGuard.__torch_dispatch__ = torch.compiler.disable(  # type: ignore[method-assign]
            _CaptureGuard.__torch_dispatch__
        )
        _CaptureGuard.compiler_disabled = True
        return lambda: None
    _CaptureGuard.compiler_disabled = True
    return lambda: set_code_exec_strategy(code, strategy)


class CheckedGraph(Graph):
    """Implements the public Graph contract over the adapter's four driver calls."""

    pool_type = CapturePool

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        self._state = _IDLE
        self._pools: list[CapturePool] = []
        self._route: contextlib.ExitStack | None = None  # the pool's segment routing
        self._guard: contextlib.ExitStack | None = None  # the capture-safety guard
        self._updates: list[Callable[[], None]] = []
        self._keeping = False  # the next (or this) capture keeps its launches readable
        self.owned_pool: CapturePool | None = None  # made by graph(); closed by reset()

    @property
    def capturing(self) -> bool:
        return self._state == _CAPTURING

    @property
    def captured(self) -> bool:
        return self._state == _CAPTURED

    def capture_begin(
        self, pool: CapturePool, op_check: OpCheck | None = None, check_ops: bool = True
    ) -> None:
        """Start recording. `check_ops=False` leaves out the per-op guard (Dynamo runs a
        compiled forward eagerly under any dispatch mode); host recorders keep it, since
        they record through it. Tensor.tolist / numpy stay blocked either way."""
        refuse_capture_inside("capture_begin")  # its allocations would land in the region
        if self._state != _IDLE:
            raise XGraphError(
                f"capture_begin: this graph is {self._state}; "
                + ("call capture_end first." if self.capturing else "reset() it first.")
            )
        if not isinstance(pool, self.pool_type):
            raise XGraphError(
                f"capture_begin: {type(self).__name__} needs a pool from "
                f"{type(self.backend).__name__}.new_pool(), got {type(pool).__name__}."
            )
        if pool.closed:
            raise PoolClosedError("capture_begin: the pool is closed; create a new one.")
        if pool.poisoned:
            raise XGraphError(
                "capture_begin: a failed capture left the runtime recording to this pool's id "
                "(no call undoes that), so it takes no more captures; capture on a new pool "
                "(backend.new_pool())."
            )
        route = contextlib.ExitStack()  # closed after the driver's end or reset
        try:
            route.enter_context(_recording())
            route.enter_context(pool.capturing())
            self._begin(pool)
            self._state = _CAPTURING
            if pool not in self._pools:
                self._pools.append(pool)
            self._route = route
            guard = contextlib.ExitStack()
            self._guard = guard
            guard.enter_context(block_host_conversions())
            if check_ops or type(self)._record_op is not Graph._record_op:
                guard.enter_context(_CaptureGuard(self, op_check))
            guard.enter_context(_current(self))
        except BaseException:
            self._undo_capture(route)
            raise

    def capture_end(self) -> None:
        if not self.capturing:
            raise XGraphError("capture_end: no capture in progress.")
        self._close_guard()  # the runtime's own end-of-capture work is not model code
        try:
            self._end()
        except BaseException:
            self._undo_capture(self._route)
            raise
        route, self._route = self._route, None
        if route is not None:
            route.close()
        self._state = _CAPTURED

    def keep_launches(self) -> bool:
        """Before capture_begin: keep the next capture readable by `launches()` (for the
        parameterization check; CUDA then instantiates the graph at its first replay).
        False where this backend cannot read what its graphs record."""
        if self._state != _IDLE:
            raise XGraphError(
                f"keep_launches: this graph is {self._state}; call it before capture_begin."
            )
        self._keeping = bool(self._keep_launches())
        return self._keeping

    def launches(self) -> list[Launch]:
        """What the capture records, in order: one Launch per kernel, op or task."""
        if not self.captured or not self._keeping:
            raise XGraphError(
                "launches: nothing readable was captured; call keep_launches() (True) before "
                "capture_begin, then capture_end."
            )
        out = self._launches()
        if not isinstance(out, list) or not all(isinstance(x, Launch) for x in out):
            raise IncompleteBackendError(
                f"{type(self).__name__}._launches returned {type(out).__name__}; it must return "
                "a list of xgraph.adapter.Launch (see docs/writing-an-adapter.md)."
            )
        return out

    def add_update(self, update: Callable[[], None]) -> None:
        """During capture: run `update` before every replay of this graph, in the order added
        (a runner re-applies per-step parameters, e.g. an NPU graph task update)."""
        if not self.capturing:
            raise XGraphError("add_update: only a graph being captured takes update callbacks.")
        self._updates.append(update)

    def replay(self) -> None:
        if self._state != _CAPTURED:
            raise XGraphError(
                "replay: the graph is still capturing; call capture_end first."
                if self.capturing
                else "replay: nothing captured; call capture_begin / capture_end first."
            )
        for pool in self._pools:
            if pool.closed:
                raise PoolClosedError(
                    "replay: the pool this graph was captured on is closed; capture it again."
                )
        for update in self._updates:
            update()
        self._replay()

    def reset(self) -> None:
        if self.capturing:
            self._undo_capture(self._route)
            return
        try:
            if self.captured:
                self.backend.synchronize()  # a queued replay may still run this graph
            self._reset()
        finally:
            self._forget()

    def abort(self) -> None:
        """End a failed capture whatever state it left, then reset; never leaves a capture on."""
        try:
            self.reset()
        except Exception:  # the capture already failed; its own error is the one to report
            logger.exception("%s: reset after a failed capture failed", type(self).__name__)

    # -- teardown --------------------------------------------------------------------------

    def _close_guard(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.close()

    def _undo_capture(self, route: contextlib.ExitStack | None) -> None:
        """Leave the guard, let the driver drop the half capture, leave the routing."""
        try:
            self._close_guard()
        finally:
            try:
                self._reset()
            finally:
                self._route = None
                if route is not None:
                    route.close()
                self._forget()

    def _forget(self) -> None:
        self._state = _IDLE
        self._pools = []
        self._updates = []
        self._keeping = False
        pool, self.owned_pool = self.owned_pool, None
        if pool is not None:
            pool.close()


@contextlib.contextmanager
def _current(g: CheckedGraph) -> Iterator[None]:
    outer = getattr(_local, "graph", None)
    _local.graph = g
    try:
        yield
    finally:
        _local.graph = outer


@contextlib.contextmanager
def graph(g: CheckedGraph, pool: CapturePool | None = None) -> Iterator[CheckedGraph]:
    """Capture the work of the block into `g`, like `torch.cuda.graph`.

    Warm the callable up first (lazy initialisation must not happen inside a capture). With
    no `pool`, the graph gets a fresh one of its own, closed by `g.reset()`. Any exception,
    KeyboardInterrupt included, aborts the capture and propagates.
    """
    backend = g.backend
    backend.synchronize()
    own = pool is None
    if pool is None:
        pool = backend.new_pool()
    try:
        g.capture_begin(pool)
    except BaseException:
        if own:
            pool.close()
        raise
    if own:
        g.owned_pool = pool
    try:
        yield g
    except BaseException:
        g.abort()
        raise
    g.capture_end()
