"""Piecewise graphs: captured pieces with attention runners executed eagerly between them.

During capture each `xgraph.attention` call ends the current piece (its output is
allocated in the pool first, inside the piece), records a runner instruction holding q, k,
v, out and the cache, and begins the next piece on the same pool. The runner does not run
during capture (on a GPU nothing runs during capture). Replay walks the instruction list:
piece, runner (planned on this step's metadata), piece, ... Only attention, the part that
depends on the batch composition, stays outside the graphs, so pieces are keyed by the
number of tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .attention import KVCache, block_direct_sdpa, check_no_bypass
from .errors import XGraphError
from .interfaces import AttentionRunner, Backend, CapturePool, Graph


@dataclass
class RunnerCall:
    """One attention call site as recorded at capture; replay runs the runner on it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    kv_cache: KVCache
    scale: float


class _BypassGuard(TorchDispatchMode):
    """Inside pieces: refuse attention kernels and any op on a KV cache (see attention.py)."""

    def __init__(self, guarded: set[int]) -> None:
        super().__init__()
        self.guarded = guarded
        self._sdpa = block_direct_sdpa()

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._sdpa.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        try:
            return super().__exit__(*exc)
        finally:
            self._sdpa.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        check_no_bypass(func, args, kwargs, self.guarded)
        return func(*args, **kwargs)


class PiecewiseGraph:
    """An instruction list of Graph pieces and RunnerCalls, replayed in capture order."""

    def __init__(
        self, backend: Backend, pool: CapturePool, guarded: set[int] | None = None
    ) -> None:
        self.backend = backend
        self.pool = pool
        self.items: list[Graph | RunnerCall] = []
        self._current: Graph | None = None
        self._guard: _BypassGuard | None = None
        self._guarded = guarded or set()

    # -- capture ---------------------------------------------------------------------------

    def begin_piece(self) -> None:
        if self._current is not None:
            raise XGraphError("begin_piece: a piece is already being captured.")
        g = self.backend.new_graph()
        g.capture_begin(self.pool)
        self._current = g
        self._guard = _BypassGuard(self._guarded)
        self._guard.__enter__()

    def end_piece(self) -> None:
        g, self._current = self._current, None
        if g is None:
            raise XGraphError("end_piece: no piece is being captured.")
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.__exit__(None, None, None)
        g.capture_end()
        self.items.append(g)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, scale: float
    ) -> torch.Tensor:
        """The call site during capture: cut the piece, record the runner, go on."""
        out = torch.empty_like(q)  # allocated inside the piece, so it lives in the pool
        self.end_piece()
        self.items.append(RunnerCall(q, k, v, out, kv_cache, scale))
        self.begin_piece()
        return out

    def abort(self) -> None:
        """Drop a failed capture: end the open piece, reset every piece."""
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.__exit__(None, None, None)
        g, self._current = self._current, None
        if g is not None:
            g.abort()
        self.reset()

    # -- replay ----------------------------------------------------------------------------

    def replay(self, runner: AttentionRunner) -> None:
        """Replay pieces in order; `runner` must already be planned for this step."""
        for item in self.items:
            if isinstance(item, RunnerCall):
                runner.run(item.q, item.k, item.v, item.out, item.kv_cache, item.scale)
            else:
                item.replay()

    def reset(self) -> None:
        for item in self.items:
            if isinstance(item, Graph):
                item.reset()
        self.items = []

    @property
    def num_pieces(self) -> int:
        return sum(1 for i in self.items if isinstance(i, Graph))

    @property
    def num_runners(self) -> int:
        return sum(1 for i in self.items if isinstance(i, RunnerCall))

    def describe(self) -> list[str]:
        return ["runner" if isinstance(i, RunnerCall) else "piece" for i in self.items]


def guarded_storages(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...] | Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors or ()}
