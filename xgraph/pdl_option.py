"""The executor's PDL option: programmatic dependent launch in the full graphs it captures.

    ex = xgraph.GraphExecutor(forward, ..., pdl=True)  # or XGRAPH_PDL=1; off by default
    ex.stats()["pdl"]  # {"enabled", "supported", "graphs", "programmatic_edges", "per_key"}

With the option on and a backend that offers PDL on this device (`Kernels.pdl`, its
`available`), the capture transaction warms up and records every full (decode) key inside
the backend's PDL capture option (`xgraph.pdl.capture_options(kernels, "full", True)`: the
warm-up too, so the launch variants it picks compile outside the capture), keeps the graph
readable (`Graph.keep_launches`) and asks the backend, once, right after capture_end, how
many of its edges are programmatic (`ProgrammaticLaunch.captured`). Piecewise (prefill)
pieces are never captured with it: PDL costs host time per launch and, by vLLM's
measurements, slows prefill. Where the backend has no PDL (the CPU backend, Ascend) or the
device does not run it (a GPU before Hopper), the option is accepted and changes nothing:
`supported` is False and no graph has programmatic edges.

Off by default: with PDL a kernel that reads its predecessor's output before waiting for it
races, so a backend's PDL is turned on once the race check (`xgraph check`,
`xgraph.pdl.race_check`) is clean for the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .kernels import Kernels
from .options import Kind, switch
from .pdl import capture_options

ENV = "XGRAPH_PDL"


def requested(pdl: bool | None) -> bool:
    """The option as given, or, for None, XGRAPH_PDL's (1 / true / on; unset: off)."""
    return switch(pdl, "pdl", ENV)


class PDLOption:
    """One executor's PDL: whether its full keys are captured with it, and their edges."""

    def __init__(self, kernels: Kernels, enabled: bool) -> None:
        self.kernels = kernels
        self.enabled = enabled
        self.edges: dict[tuple, int | None] = {}  # per key captured with PDL

    @property
    def supported(self) -> bool:
        """Whether the backend runs PDL on this device."""
        launch = self.kernels.pdl
        return launch is not None and bool(launch.available)

    def applies(self, kind: Kind) -> bool:
        """Whether a key of this kind is captured with PDL: full keys, option on, supported."""
        return kind is Kind.FULL and self.enabled and self.supported

    def around(self, kind: Kind) -> AbstractContextManager[Any]:
        """The context of a key's warm-up and of its record."""
        if not self.applies(kind):
            return nullcontext()
        return capture_options(self.kernels, Kind.FULL.value, True)

    def prepare(self, kind: Kind, recording: Any) -> None:
        """Before the record begins: a full key's graph kept readable, for its edge count."""
        if self.applies(kind):
            recording.graph.keep_launches()

    def captured(self, key: tuple, kind: Kind, recording: Any) -> None:
        """Right after the record ends: the backend's count of its programmatic edges."""
        if self.applies(kind):
            assert self.kernels.pdl is not None
            self.edges[key] = self.kernels.pdl.captured(recording.graph)

    def stats(self, keys: Iterable[tuple]) -> dict[str, Any]:
        """The option, whether the backend supports it here, and the full graphs among the
        cached `keys` captured with it with their programmatic edges (the total is None
        where the backend could not read a graph's edges)."""
        per_key = {k: self.edges[k] for k in keys if k in self.edges}
        counts = list(per_key.values())
        total = None if None in counts else sum(c for c in counts if c is not None)
        return {
            "enabled": self.enabled,
            "supported": self.supported,
            "graphs": len(per_key),
            "programmatic_edges": total,
            "per_key": per_key,
        }
