"""An adapter whose graph forgets `_reset` and whose backend forgets `as_tensor`: refused."""

from __future__ import annotations

import torch

from xgraph.adapter import Availability, Backend, BackendSpec, CapturePool, CheckedGraph, hookimpl


class HalfGraph(CheckedGraph):
    def _begin(self, pool: CapturePool) -> None: ...

    def _end(self) -> None: ...

    def _replay(self) -> None: ...

    # _reset() is missing, and so is pool_type


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
            hidden=True,
        )
    ]
