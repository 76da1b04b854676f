"""An adapter whose graph class forgets `reset`: xgraph must refuse it with a clear error."""

from __future__ import annotations

import torch

from xgraph.interfaces import Availability, Backend, CapturePool, Graph
from xgraph.plugins import BackendSpec, hookimpl


class HalfGraph(Graph):
    def capture_begin(self, pool: CapturePool) -> None: ...

    def capture_end(self) -> None: ...

    def replay(self) -> None: ...

    # reset() is missing


class IncompleteBackend(Backend):
    name = "dummy-incomplete"
    priority = 5
    graph_class = HalfGraph

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "claims to be available")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_pool(self, segments=None) -> CapturePool:
        raise AssertionError("never reached: the backend is rejected first")

    def synchronize(self) -> None: ...

    # as_tensor() is missing


@hookimpl
def xgraph_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="dummy-incomplete",
            priority=5,
            backend="xgraph_dummy.incomplete:IncompleteBackend",
            probe="xgraph_dummy.incomplete:IncompleteBackend.availability",
            distribution="xgraph-dummy",
        )
    ]
