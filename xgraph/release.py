"""How a GraphExecutor gives its device memory back: for a while (`sleep`, `wake`:
xgraph.sleepmode, docs/sleep.md) or for good (`close`: xgraph.lifetime)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import sleepmode

if TYPE_CHECKING:
    import weakref

    from .keycache import KeyCache
    from .lifetime import Holdings
    from .steps import StepPlanner


class Release:
    """`sleep`, `wake`, `close` and `closed` of a GraphExecutor."""

    planner: StepPlanner
    _held: Holdings
    _finalizer: weakref.finalize
    cache: KeyCache

    if TYPE_CHECKING:  # GraphExecutor's

        def _exclusive(self, what: str) -> Any: ...

    @property
    def closed(self) -> bool:
        """Whether close() ran (or the executor was released when collected)."""
        return self._held.closed

    def sleep(self) -> sleepmode.SleepReport:
        """Give back the physical memory of graph memory and persistent buffers, keeping every
        address: steps raise AsleepError until wake(), which replays every key with no
        recapture. Executors sharing the graph memory sleep too (docs/sleep.md)."""
        return sleepmode.sleep(self, tags=())

    def wake(self) -> sleepmode.WakeReport:
        """Map fresh memory at the addresses sleep() kept; idempotent (docs/sleep.md)."""
        return sleepmode.wake(self, tags=())

    def close(self) -> None:
        """Wait for queued work, reset every graph, give back the persistent buffers and
        graph memory (if owned); any use afterwards raises XGraphError.

        Safe right after steps, with no synchronize of the caller's: replays still queued
        on the device finish before any memory they use is unmapped or freed. An executor
        dropped without close() does the same when it is collected (xgraph.lifetime).
        """
        if self._held.closed:
            return
        with self._exclusive("close"):
            self._finalizer.detach()
            self.planner.close()  # first: nothing plans into the buffers that go below
            # output buffers: their memory goes with the caller's last view of them
            self.cache.drop_outputs()
            self._held.release(buffers=True)
