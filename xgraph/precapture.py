"""Pre-capture: the graphs of chosen sizes recorded (or only warmed up) before serving.

Each size runs a synthetic step that touches only the dummy slot and block (the planner
builds it); sizes are checked, all of them, before the first runs.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .capture_session import capture_session
from .errors import InputError, XGraphError
from .options import Kind
from .progress import progress as show_progress

if TYPE_CHECKING:
    from .buckets import Buckets
    from .memory_plan import MemoryPlan
    from .steplock import StepLock
    from .steps import Step, StepPlanner


class PreCapture:
    """`capture` and `warm_up` of a GraphExecutor."""

    name: str
    buckets: Buckets
    planner: StepPlanner
    _steps: StepLock

    if TYPE_CHECKING:  # GraphExecutor's

        def _exclusive(self, what: str) -> Any: ...
        def _run(self, step: Step) -> Any: ...

    def capture(
        self,
        sizes: Iterable[int] | None = None,
        kind: Kind | str = Kind.FULL,
        progress: bool = True,
        query_len: int = 1,
        **key_dims: int,
    ) -> None:
        """Capture graphs before serving: one per num_tokens size, in the order given.

        Default: every bucket, largest first (what a shared native pool needs). Each capture
        runs on a synthetic step that touches only the dummy slot and block; `key_dims` fix
        the sizes of other shape-determining dims. Sizes are ints from 1 to the largest
        bucket (InputError otherwise); one between buckets is padded to the next.
        `query_len` > 1 captures the full graphs of steps of that many tokens per sequence
        (speculative verification); sizes then count sequences.
        """
        k = Kind.parse(kind, "kind")
        if k is Kind.EAGER:
            raise XGraphError("kind='eager': choose 'full' or 'piecewise'.")
        what = f"{self.name}: capturing {k.value} graphs"
        self._synthetic(sizes, k, k, what, progress, key_dims, query_len)

    def plan_memory(self, kinds: Iterable[Kind | str] | None = None) -> MemoryPlan:
        """The graph memory every bucket will need, measured on twin captures of the largest
        keys and undone (`xgraph.predict_graph_memory`); callable before serving."""
        from .memory_plan import predict_graph_memory

        return predict_graph_memory(self, kinds=kinds)  # type: ignore[arg-type]

    def warm_up(
        self, sizes: Iterable[int] | None = None, kind: Kind | str = Kind.FULL, **key_dims: int
    ) -> None:
        """Run the synthetic steps `capture` would record, eagerly, recording nothing: kernels
        compile and load, and libraries set up, before any capture or memory reading."""
        k = Kind.parse(kind, "kind")
        if k is Kind.EAGER:
            raise XGraphError("kind='eager': choose the layout, 'full' or 'piecewise'.")
        self._synthetic(sizes, k, Kind.EAGER, f"{self.name}: warm-up", False, key_dims)

    def _synthetic(
        self,
        sizes: Iterable[int] | None,
        layout: Kind,
        run: Kind,
        what: str,
        progress: bool,
        key_dims: dict[str, int],
        query_len: int = 1,
    ) -> None:
        todo = self._sizes(sizes, what)
        if query_len > 1:  # sizes count sequences of query_len tokens
            top = self.buckets.max
            if sizes is None:
                todo = [n for n in todo if n * query_len <= top]
            elif max(todo, default=0) * query_len > top:
                raise InputError(
                    f"{what}: {max(todo)} sequences of {query_len} tokens are above the "
                    f"largest bucket ({top}); give at most {top // query_len} sequences."
                )
        with capture_session():  # the collector off: xgraph.capture_session says why
            for n in show_progress(todo, what, progress):
                tensors, attn = self.planner.synthetic(n, layout, key_dims, query_len)
                with self._exclusive("capture"):
                    step = self.planner.plan(tensors, attn, kind=run, synthetic=True)
                    self._steps.acquire(self.name)  # as a step: one at a time over shared memory
                    try:
                        self._run(step)
                    finally:
                        self._steps.release()

    def _sizes(self, sizes: Iterable[int] | None, what: str) -> list[int]:
        """The sizes to pre-capture, every one checked before any runs."""
        if sizes is None:
            return sorted(self.buckets.sizes, reverse=True)
        if isinstance(sizes, (int, str)):
            raise InputError(f"{what}: sizes must be a list of ints, got {sizes!r}.")
        todo, top = [], self.buckets.max
        for n in sizes:
            try:
                m = operator.index(n)  # ints and numpy ints; not floats or strings
            except TypeError:
                m = None
            if m is None or isinstance(n, bool) or not 1 <= m <= top:
                raise InputError(
                    f"{what}: sizes holds {n!r}; each size is a number of tokens, an int from 1 "
                    f"to the largest bucket ({top}). Pass sizes in that range, or add a bucket."
                )
            todo.append(m)
        return todo
