"""Conformance of the hard paths: teardown without a synchronize, interrupts mid-capture,
injected driver and runtime failures with balanced books, a capture in another thread.

Each test ends with fresh device work, a synchronize and the books of the backend's
virtual memory back where they started: on a GPU, memory unmapped under a queued kernel
poisons the context, and the next synchronize says so. Injection goes through overridable
fixtures, so an adapter can fail its real driver calls (`inject_driver_failure`) and its
runtime's capture end (`fail_capture_end`); the defaults work on any backend.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

import xgraph
from xgraph.errors import CaptureError, VirtualMemoryError, XGraphWarning
from xgraph.interfaces import Backend

from .base import BackendTests
from .faults import fail_driver_call

BUCKETS = [8, 16, 32, 64]
DRIVER_CALLS = {"create": "_create_chunk", "map": "_map_chunk", "reserve": "_reserve_range"}


class _RefusingEnd:
    """A runtime graph whose next capture_end is refused before the runtime ends anything."""

    def __init__(self, graph: Any, armed: dict[str, bool]) -> None:
        self._graph, self._armed = graph, armed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._graph, name)

    def capture_end(self) -> None:
        if self._armed["on"]:
            self._armed["on"] = False
            raise RuntimeError("capture_end refused (injected by xgraph.testing.reliability)")
        self._graph.capture_end()


class ReliabilityTests(BackendTests):
    """Teardown, interrupts and failures leave the device healthy and the books balanced."""

    #: the forward's width and depth: an accelerator adapter raises them until a replay
    #: keeps the device busy for milliseconds (queued work at close)
    busy_width: ClassVar[int] = 256
    busy_depth: ClassVar[int] = 4

    # -- overridable fixtures --------------------------------------------------------------

    @pytest.fixture(params=[("create", 1), ("create", 3), ("map", 2), ("reserve", 1)])
    def driver_failure(self, request: pytest.FixtureRequest) -> tuple[str, int]:
        """(kind, n): the n-th driver call of that kind ("create", "map", "reserve") fails."""
        return request.param  # type: ignore[no-any-return]

    @pytest.fixture
    def inject_driver_failure(
        self, backend: Backend
    ) -> Callable[[str, int], contextlib.AbstractContextManager[Any]]:
        """A factory of contexts in which the n-th driver call of a kind fails. The default
        fails the VirtualMemory's driver method; an adapter fails its real driver call."""
        vm = backend.virtual_memory()
        return lambda kind, nth: fail_driver_call(vm, DRIVER_CALLS[kind], nth=nth)  # type: ignore[arg-type]

    @pytest.fixture
    def fail_capture_end(
        self, backend: Backend, monkeypatch: pytest.MonkeyPatch
    ) -> Callable[[], None]:
        """Arms a refusal of the next capture's end by the runtime. The default wraps a
        torch-style backend's runtime graphs (the capture stays on, as after a real
        refusal), else makes the graph's own end raise."""
        armed = {"on": False}
        runtime = getattr(backend, "runtime", None)
        if runtime is not None and hasattr(runtime, "new_graph"):
            new_graph = runtime.new_graph
            monkeypatch.setattr(runtime, "new_graph", lambda: _RefusingEnd(new_graph(), armed))
        else:
            graph_cls = type(backend.new_graph())
            end = graph_cls._end  # type: ignore[attr-defined]

            def refusing(graph: Any) -> None:
                if armed["on"]:
                    armed["on"] = False
                    raise CaptureError("capture_end refused (injected)")
                end(graph)

            monkeypatch.setattr(graph_cls, "_end", refusing)
        return lambda: armed.update(on=True)

    # -- helpers ---------------------------------------------------------------------------

    def busy(self, backend: Backend) -> Callable[[torch.Tensor], torch.Tensor]:
        width, dev = self.busy_width, backend.device
        g = torch.Generator().manual_seed(0)
        ws = [
            (torch.randn(width, width, generator=g, device="cpu") / width**0.5).to(dev)
            for _ in range(3)
        ]

        def forward(x: torch.Tensor) -> torch.Tensor:
            h = x.repeat(1, width // x.shape[1])
            for i in range(self.busy_depth):
                h = torch.tanh(h @ ws[i % len(ws)])
            return h[:, : x.shape[1]] * 1

        return forward

    def executor(self, backend: Backend, fn: Any, memory: Any = None, **kw: Any) -> Any:
        return xgraph.GraphExecutor(
            fn,
            backend=backend,
            buckets=BUCKETS,
            memory=memory,
            inputs=[xgraph.Input("x", torch.float32, ("num_tokens", 64))],
            **kw,
        )

    def books(self, backend: Backend) -> dict[str, int] | None:
        vm = backend.virtual_memory()
        return vm.live() if vm is not None else None  # type: ignore[attr-defined]

    def assert_healthy(self, backend: Backend, books: dict[str, int] | None) -> None:
        backend.synchronize()  # a GPU reports a kernel that hit unmapped memory here
        x = torch.arange(1024, device=backend.device, dtype=torch.float32)
        assert float((x * 2).sum()) == 1023 * 1024
        assert self.books(backend) == books

    def memory_mode(self, mode: str, has_vm: bool, routes: bool) -> str:
        """`mode`, or shared-pool where shared-physical memory is not offered here."""
        return mode if mode != "shared-physical" or (has_vm and routes) else "shared-pool"

    def wide(self, chunk: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """A forward whose activations at 64 tokens span about four chunks each."""
        reps = max(1, 4 * chunk // (64 * 64 * 4))

        def forward(x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x.repeat(1, reps) * 2)
            return (h + 1)[:, : x.shape[1]] * 1

        return forward

    # -- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("memory", ["shared-physical", "shared-pool", "private"])
    def test_close_right_after_queued_replays_needs_no_synchronize(
        self, backend: Backend, memory: str, has_virtual_memory: bool, routes_segments: bool
    ) -> None:
        books = self.books(backend)
        mode = self.memory_mode(memory, has_virtual_memory, routes_segments)
        ex = self.executor(backend, self.busy(backend), mode)
        for n in BUCKETS:  # capture every bucket
            ex(x=torch.randn(n, 64))
        backend.synchronize()
        for _ in range(5):  # queue replays, read nothing
            for n in BUCKETS:
                ex(x=torch.randn(n, 64))
        ex.close()  # no synchronize before: close must wait for the queued replays
        self.assert_healthy(backend, books)

    def test_an_interrupt_and_a_failed_capture_leave_the_backend_usable(
        self, backend: Backend
    ) -> None:
        busy, calls = self.busy(backend), {"16": 0}

        def flaky(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 16:
                calls["16"] += 1
                if calls["16"] == 2:  # in the first capture (the warm-up is the first call)
                    raise KeyboardInterrupt
            if x.shape[0] == 32:
                x = x * (x.sum().item() != 0)  # a host read: this key fails to capture
            return busy(x)

        books = self.books(backend)
        ex = self.executor(backend, flaky)
        ex(x=torch.randn(8, 64))
        with pytest.raises(KeyboardInterrupt):
            ex(x=torch.randn(16, 64))
        with pytest.warns(XGraphWarning):
            ex(x=torch.randn(32, 64))
        assert torch.Tensor.tolist(torch.ones(1)) == [1.0]  # host reads unblocked again
        for n in (8, 16, 8):  # the interrupted key captures now; the first one replays
            x = torch.randn(n, 64)
            with torch.no_grad():
                self.assert_matches(backend, ex(x=x), busy(x.to(backend.device)))
        ex.close()
        self.assert_healthy(backend, books)

    def test_an_injected_driver_failure_rolls_back_with_balanced_books(
        self,
        backend: Backend,
        driver_failure: tuple[str, int],
        inject_driver_failure: Callable[[str, int], contextlib.AbstractContextManager[Any]],
        has_virtual_memory: bool,
        routes_segments: bool,
    ) -> None:
        if not (has_virtual_memory and routes_segments):  # no driver call during captures
            assert xgraph.GraphMemory(backend).mode.value != "shared-physical"
            return
        books = self.books(backend)
        mem = xgraph.GraphMemory(backend, "shared-physical")
        fn = self.wide(mem.physical.chunk_size)  # type: ignore[union-attr]
        ex = self.executor(backend, fn, mem, on_capture_error="raise")
        with inject_driver_failure(*driver_failure), pytest.raises(VirtualMemoryError):
            ex(x=torch.randn(64, 64))
        assert self.books(backend) == books and mem.physical.stats()["chunks"] == 0  # type: ignore[union-attr]
        for n in (64, 8, 40):  # the failed key captures now, and others too
            x = torch.randn(n, 64)
            with torch.no_grad():
                self.assert_matches(backend, ex(x=x), fn(x.to(backend.device)))
        ex.close()
        mem.close()
        self.assert_healthy(backend, books)

    def test_a_refused_capture_end_in_shared_pool_mode_is_followed_by_more_captures(
        self, backend: Backend, fail_capture_end: Callable[[], None]
    ) -> None:
        busy, books = self.busy(backend), self.books(backend)
        ex = self.executor(backend, busy, "shared-pool")
        ex(x=torch.randn(8, 64))
        fail_capture_end()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ex(x=torch.randn(16, 64))  # refused: rolled back, runs eagerly from now on
        assert any(issubclass(c.category, XGraphWarning) for c in caught)
        for n in (32, 8, 16, 32):  # later keys capture (on a fresh pool); the first replays
            x = torch.randn(n, 64)
            with torch.no_grad():
                self.assert_matches(backend, ex(x=x), busy(x.to(backend.device)))
        s = ex.stats()
        assert set(s["hits"]) == {("full", 8), ("full", 32)} and ("full", 16) in s["failed_keys"]
        ex.close()
        self.assert_healthy(backend, books)

    def test_another_thread_synchronizes_and_closes_while_a_capture_runs(
        self, backend: Backend
    ) -> None:
        books, busy = self.books(backend), self.busy(backend)
        ex = self.executor(backend, busy)
        for n in (8, 16):
            ex(x=torch.randn(n, 64))
        started, release, out = threading.Event(), threading.Event(), {}
        worker = threading.Thread(target=self._held_capture, args=(backend, started, release, out))
        worker.start()
        try:
            assert started.wait(60)
            backend.synchronize()  # never a device-wide call that fails during a capture
            ex.close()  # synchronizes and gives its pools back (once the capture ends)
        finally:
            release.set()
            worker.join(60)
        assert "error" not in out, out.get("error")
        out["x"].fill_(4)
        out["graph"].replay()
        backend.synchronize()
        assert torch.equal(out["y"].cpu(), torch.full((16,), 5.0))
        out["graph"].reset()
        out["pool"].close()
        del out
        self.assert_healthy(backend, books)

    @staticmethod
    def _held_capture(
        backend: Backend, started: threading.Event, release: threading.Event, out: dict
    ) -> None:
        """A capture begun in this thread and held until `release` is set."""
        try:
            x, pool = torch.zeros(16, device=backend.device), backend.new_pool()
            graph = backend.new_graph()
            with torch.no_grad():
                graph.capture_begin(pool)
                try:
                    y = x + 1
                finally:
                    started.set()
                    release.wait(60)
                    graph.capture_end()
            out.update(graph=graph, pool=pool, x=x, y=y)
        except BaseException as exc:  # reported by the test's thread
            out["error"] = repr(exc)
            started.set()
