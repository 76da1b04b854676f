"""The CPU reference graph: CheckedGraph's four driver calls over an OpTape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...graphs import CheckedGraph
from ...interfaces import CapturePool, Launch
from .pool import HostCachingPool
from .tape import OpTape

if TYPE_CHECKING:
    from .backend import CPUBackend


class CPUGraph(CheckedGraph):
    """Records the ops of a capture on the host and re-executes them on replay."""

    pool_type = HostCachingPool
    backend: CPUBackend

    def __init__(self, backend: CPUBackend) -> None:
        super().__init__(backend)
        self.tape = OpTape()

    def _begin(self, pool: CapturePool) -> None:
        assert isinstance(pool, HostCachingPool)  # CheckedGraph checked pool_type
        self.tape.begin(pool)

    def _record_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        return self.tape.record(func, args, kwargs, out)

    def _keep_launches(self) -> bool:
        self.tape.keep_launches()
        return True

    def _launches(self) -> list[Launch]:
        return self.tape.launches()

    def _end(self) -> None:
        self.tape.seal()

    def _replay(self) -> None:
        self.tape.replay()
        self.backend.queued += 1  # as if queued on a device: see CPUBackend.queued

    def _reset(self) -> None:
        self.tape.clear()
