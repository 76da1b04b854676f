"""The simulator's planted PDL the PDL tests share (`from planted_pdl import ...`; pytest's
default import mode puts tests/ on sys.path). Not a test module.

Inside a full graph's capture with PDL on, `state.pdl` is set: a test's forward reads it to
let a kernel that skips its wait overlap its predecessor and read what that one has not
written yet. Every launch of a graph captured with it is linked to the one before by a
programmatic edge.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from xgraph.kernels import ProgrammaticLaunch

state = threading.local()


class PlantedPDL(ProgrammaticLaunch):
    """PDL on the simulator (see the module docstring); `asked` records every capture's
    (kind, enabled)."""

    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.asked: list[tuple[str, bool]] = []

    @contextmanager
    def _on(self, on: bool) -> Iterator[None]:
        before = getattr(state, "pdl", False)
        state.pdl = on
        try:
            yield
        finally:
            state.pdl = before

    def capture(self, kind: str, enabled: bool) -> AbstractContextManager[Any]:
        self.asked.append((kind, enabled))
        return self._on(enabled and kind == "full" and self.available)

    def programmatic_edges(self, graph: Any) -> int | None:
        return max(len(graph.launches()) - 1, 0)  # the graph was kept readable
