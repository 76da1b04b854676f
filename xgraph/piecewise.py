"""Full and piecewise recordings of one forward: what the executor caches per key.

Full: one graph; attention runs inline inside it (a graph-safe runner, reading every
per-step value from device buffers). A full graph key that serves device-resident
metadata has the device check (xgraph.device_check) as its first piece: one graph of the
check's ops on the key's pool, run before the forward's graph on the steps whose
metadata is on the device (host metadata is checked on the host), or, where it could not
be recorded and the policy allows, the same ops issued eagerly.

Piecewise: during capture each `xgraph.attention` call ends the current piece (its output
is allocated in the pool first, inside the piece), records a runner instruction holding q,
k, v, out and the cache, and begins the next piece on the same pool. The runner does not
run during capture (on a GPU nothing runs during capture). Replay walks the instruction
list: piece, runner (planned on this step's metadata), piece, ... Only attention, the part
that depends on the batch composition, stays outside the graphs, so pieces are keyed by the
number of tokens alone. Attention kernels and KV-cache ops inside a piece are refused: they
would be frozen with the capture step's batch composition.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from .attention import InlineRunner, StepContext
from .device_check import CheckOps
from .errors import CaptureError, XGraphError
from .interfaces import AttentionRunner, Backend, CapturePool, Graph
from .metadata import KVCache
from .safety import ScopedPatch, model_location


class FullGraph:
    """One graph for the whole forward, and the device check's graph before it where the
    key serves device metadata; `context` runs attention inline while it records."""

    def __init__(
        self,
        backend: Backend,
        pool: CapturePool,
        runner: AttentionRunner | None,
        check_ops: bool = True,
    ):
        self.backend = backend
        self.graph = backend.new_graph()
        self.pool = pool
        self.check_ops = check_ops
        if runner is not None and not runner.graph_safe:
            raise XGraphError(
                f"{type(runner).__name__} is not graph-safe, so it cannot run inside a full "
                "graph. Use a graph-safe runner for decode, or the piecewise mode."
            )
        self.context: StepContext | None = InlineRunner(runner) if runner is not None else None
        self.check_graph: Graph | None = None  # the device check's graph, its first piece
        self.device_check: CheckOps | None = None  # the check it serves (recorded or eager)
        self._eager_check = False  # where it could not be recorded: its ops, issued eagerly

    def begin(self) -> None:
        self.graph.capture_begin(self.pool, check_ops=self.check_ops)

    def end(self) -> None:
        self.graph.capture_end()

    def abort(self) -> None:
        try:
            self.graph.abort()
        finally:
            self.drop_check()

    # -- the device check, the first piece --------------------------------------------------

    def record_check(self, ops: CheckOps, pool: CapturePool | None = None) -> None:
        """Record the device check's ops as one graph on `pool` (default: the forward's);
        a failed recording leaves no check."""
        g = self.backend.new_graph()
        self.check_graph = g  # kept first, so drop_check resets it whatever fails below
        try:
            g.capture_begin(pool or self.pool, check_ops=self.check_ops)
            ops()
            g.capture_end()
        except BaseException:
            self.drop_check()
            raise
        self.device_check = ops

    def run_check_eagerly(self, ops: CheckOps) -> None:
        """From now on the key's check issues its ops eagerly each step (not recorded)."""
        self.device_check, self._eager_check = ops, True

    @property
    def has_check(self) -> bool:
        return self.device_check is not None

    def run_check(self) -> None:
        """The check before a device-metadata step's replay (recorded or eager)."""
        if self.check_graph is not None:
            self.check_graph.replay()
        else:
            assert self.device_check is not None and self._eager_check
            self.device_check()

    def drop_check(self) -> None:
        g, self.check_graph = self.check_graph, None
        self.device_check, self._eager_check = None, False
        if g is not None:
            g.abort()  # a reset, whatever state a failed capture left

    def replay(self) -> None:
        self.graph.replay()

    def reset(self) -> None:
        try:
            self.graph.reset()
        finally:
            self.drop_check()

    def describe(self) -> list[str]:
        return (["check"] if self.device_check is not None else []) + ["graph"]


@dataclass
class RunnerCall:
    """One attention call site as recorded at capture; replay runs the runner on it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    kv_cache: KVCache
    scale: float


def _bypass_message(what: str) -> str:
    return (
        f"Capture failed: {what} ran inside a piecewise graph at {model_location()}. "
        "Attention must go through `xgraph.attention(q, k, v, kv_cache)` so it runs between "
        "pieces on each step's metadata; called directly it would be frozen with the batch "
        "composition of the capture step. Route it through the call site."
    )


def _refuse_sdpa(*args: Any, **kwargs: Any) -> Any:
    raise CaptureError(_bypass_message("torch.nn.functional.scaled_dot_product_attention"))


# SDPA may read host values before its kernel op is dispatched, so the op-level check alone
# could report a misleading host read instead of the bypass
_direct_sdpa = ScopedPatch(torch.nn.functional, {"scaled_dot_product_attention": _refuse_sdpa})


_ATTENTION_KERNELS = ("scaled_dot_product", "flash_attention", "efficient_attention")
_not_attention: set[Any] = set()  # ops whose names name no attention kernel


class _BypassCheck:
    """The op check of every piece: no attention kernel, no op on a KV cache tensor."""

    def __init__(self, guarded: set[int]) -> None:
        self.guarded = guarded

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func not in _not_attention:  # the name, read once per op
            name = func._schema.name
            if any(k in name for k in _ATTENTION_KERNELS):
                raise CaptureError(_bypass_message(f"{func} (an attention kernel)"))
            _not_attention.add(func)
        guarded = self.guarded
        if not guarded:
            return
        for a in args:
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in guarded:
                raise CaptureError(_bypass_message(f"{func} on a KV cache tensor"))


class PiecewiseGraph:
    """An instruction list of Graph pieces and RunnerCalls, replayed in capture order."""

    def __init__(
        self,
        backend: Backend,
        pool: CapturePool,
        runner: AttentionRunner | None,
        guarded: set[int] | None = None,
        check_ops: bool = True,
    ) -> None:
        self.backend = backend
        self.check_ops = check_ops
        self.pool = pool
        self.runner = runner
        self.items: list[Graph | RunnerCall] = []
        self._current: Graph | None = None
        self._check = _BypassCheck(guarded or set())
        self._scope: contextlib.ExitStack | None = None
        self.context: StepContext = self

    # -- capture ---------------------------------------------------------------------------

    def begin(self) -> None:
        scope = contextlib.ExitStack()
        scope.enter_context(_direct_sdpa.scope())
        self._scope = scope
        self._begin_piece()

    def end(self) -> None:
        self._end_piece()
        self._leave_scope()

    def _begin_piece(self) -> None:
        if self._current is not None:
            raise XGraphError("begin_piece: a piece is already being captured.")
        g = self.backend.new_graph()
        g.capture_begin(self.pool, op_check=self._check, check_ops=self.check_ops)
        self._current = g

    def _end_piece(self) -> None:
        g, self._current = self._current, None
        if g is None:
            raise XGraphError("end_piece: no piece is being captured.")
        self.items.append(g)  # listed first, so reset() drops it even if capture_end fails
        g.capture_end()

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, scale: float
    ) -> torch.Tensor:
        """The call site during capture: cut the piece, record the runner, go on."""
        out = torch.empty_like(q)  # allocated inside the piece, so it lives in the pool
        self._end_piece()
        self.items.append(RunnerCall(q, k, v, out, kv_cache, scale))
        self._begin_piece()
        return out

    def abort(self) -> None:
        """Drop a failed capture: end the open piece, reset every piece."""
        try:
            g, self._current = self._current, None
            if g is not None:
                g.abort()
        finally:
            self._leave_scope()
            self.reset()

    def _leave_scope(self) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.close()

    # -- replay ----------------------------------------------------------------------------

    def replay(self) -> None:
        """Replay pieces in order; the runner must already be planned for this step."""
        runner = self.runner
        for item in self.items:
            if isinstance(item, RunnerCall):
                if runner is None:
                    raise XGraphError("a piecewise graph with attention calls needs a runner")
                runner.run(item.q, item.k, item.v, item.out, item.kv_cache, item.scale)
            else:
                item.replay()

    def reset(self) -> None:
        for item in self.items:
            if isinstance(item, Graph):
                item.reset()
        self.items = []
        self.runner = None  # its last plan views the executor's buffers: they go at close

    def describe(self) -> list[str]:
        return ["runner" if isinstance(i, RunnerCall) else "piece" for i in self.items]


def guarded_storages(tensors: Any) -> set[int]:
    """Storage addresses of the KV cache tensors (the bypass check refuses ops on them)."""
    return {t.untyped_storage().data_ptr() for t in tensors or ()}
