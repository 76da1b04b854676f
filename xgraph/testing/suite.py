"""The conformance suite: abstract test classes every backend runs against itself.

An adapter subclasses `ConformanceSuite` (or single classes) and names its backend::

    from xgraph.testing import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        backend_name = "mybackend"

or runs `xgraph conformance --backend mybackend`. Without `backend_name` the backend comes
from `--xgraph-backend`, then XGRAPH_BACKEND, then the best available one. A backend that
is not available here makes the tests skip with its reason.
"""

from __future__ import annotations

import inspect
import os
from typing import ClassVar

import pytest
import torch

import xgraph
from xgraph.errors import BackendUnavailableError, CaptureError, VirtualMemoryError
from xgraph.interfaces import Backend, Graph


def _line_of(fn, needle: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if needle in line:
            return start + i
    raise AssertionError(f"{needle!r} not in {fn.__name__}")


class BackendTests:
    """Fixtures shared by every conformance class."""

    backend_name: ClassVar[str | None] = None
    #: tolerance for device backends (float32; the CPU backend is checked bit for bit)
    rtol: ClassVar[float] = 1e-5
    atol: ClassVar[float] = 1e-5
    bitwise: ClassVar[bool | None] = None  # None: bitwise on cpu, tolerance elsewhere

    @pytest.fixture
    def backend(self, request: pytest.FixtureRequest) -> Backend:
        name = (
            self.backend_name
            or request.config.getoption("xgraph_backend", default=None)
            or os.environ.get("XGRAPH_BACKEND")
            or None
        )
        try:
            return xgraph.get_backend(name)
        except BackendUnavailableError as exc:
            pytest.skip(str(exc))

    def assert_matches(
        self, backend: Backend, actual: torch.Tensor, expected: torch.Tensor
    ) -> None:
        bitwise = self.bitwise if self.bitwise is not None else backend.device.type == "cpu"
        if bitwise:
            assert actual.dtype == expected.dtype and actual.shape == expected.shape
            assert torch.equal(actual, expected), (actual - expected).abs().max()
        else:
            torch.testing.assert_close(actual, expected, rtol=self.rtol, atol=self.atol)


def _mlp(device: torch.device, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.SiLU(), torch.nn.Linear(128, 32), torch.nn.LayerNorm(32)
    )
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.to(device).eval()


def capture(backend: Backend, graph: Graph, pool, fn, *args):
    """Warm up, then capture fn(*args) on `pool`; returns fn's (pool-backed) output."""
    with torch.no_grad():
        fn(*args)
        backend.synchronize()
        graph.capture_begin(pool)
        try:
            out = fn(*args)
        except BaseException:
            graph.abort()
            raise
        graph.capture_end()
    return out


class GraphTests(BackendTests):
    """Graph: capture records, replay follows new input values on the same addresses."""

    def test_replay_follows_new_inputs(self, backend: Backend) -> None:
        dev = backend.device
        mlp = _mlp(dev)
        x = torch.randn(16, 32, device=dev)
        graph, pool = backend.new_graph(), backend.new_pool()
        y = capture(backend, graph, pool, mlp, x)
        address = y.data_ptr()
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            x.copy_(torch.randn(16, 32, generator=gen))
            graph.replay()
            backend.synchronize()
            with torch.no_grad():
                self.assert_matches(backend, y, mlp(x))
        assert y.data_ptr() == address
        graph.reset()
        pool.close()

    def test_python_control_flow_is_frozen_at_capture(self, backend: Backend) -> None:
        dev = backend.device
        x = torch.ones(8, device=dev)
        state = {"double": True}

        def fn(t: torch.Tensor) -> torch.Tensor:
            return t * 2 if state["double"] else t * 3

        graph, pool = backend.new_graph(), backend.new_pool()
        y = capture(backend, graph, pool, fn, x)
        state["double"] = False
        x.fill_(5)
        graph.replay()
        backend.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 10.0))
        graph.reset()
        pool.close()

    def test_reset_then_capture_again(self, backend: Backend) -> None:
        dev = backend.device
        x = torch.arange(8, dtype=torch.float32, device=dev)
        graph, pool = backend.new_graph(), backend.new_pool()
        capture(backend, graph, pool, lambda t: t + 1, x)
        graph.reset()
        y = capture(backend, graph, pool, lambda t: t * 10, x)
        x.fill_(2)
        graph.replay()
        backend.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 20.0))
        graph.reset()
        pool.close()

    def test_two_graphs_on_one_pool_in_order(self, backend: Backend) -> None:
        """Pieces of one forward: the second graph reads what the first wrote into the pool."""
        dev = backend.device
        x = torch.randn(64, device=dev)
        pool = backend.new_pool()
        g1, g2 = backend.new_graph(), backend.new_graph()
        with torch.no_grad():
            a = x.exp()  # warm-up of both pieces
            (a * 2).sum(0, keepdim=True)
            backend.synchronize()
            g1.capture_begin(pool)
            a = x.exp()
            g1.capture_end()
            g2.capture_begin(pool)
            b = (a * 2).sum(0, keepdim=True)
            g2.capture_end()
        for _ in range(5):
            x.copy_(torch.randn(64))
            g1.replay()
            g2.replay()
            backend.synchronize()
            self.assert_matches(backend, b, (x.exp() * 2).sum(0, keepdim=True))
        g1.reset()
        g2.reset()
        del a, b
        pool.close()

    @pytest.mark.parametrize("op", ["item", "tolist", "nonzero"])
    def test_host_read_raises_capture_error(self, backend: Backend, op: str) -> None:
        dev = backend.device
        x = torch.randn(8, device=dev)

        def forward(t: torch.Tensor) -> torch.Tensor:
            if op == "item":
                s = t.sum().item()  # host read: the line the error must name
            elif op == "tolist":
                s = t.tolist()[0]  # host read: the line the error must name
            else:
                s = t.nonzero().shape[0]  # host read: the line the error must name
            return t * s

        graph, pool = backend.new_graph(), backend.new_pool()
        with pytest.raises(CaptureError) as info:
            capture(backend, graph, pool, forward, x)
        needle = {"item": "t.sum().item()", "tolist": "t.tolist()", "nonzero": "t.nonzero()"}[op]
        line = _line_of(forward, needle)
        msg = str(info.value)
        assert f"{os.path.basename(__file__)}:{line}" in msg, msg
        assert {"item": "_local_scalar_dense", "tolist": "tolist", "nonzero": "nonzero"}[op] in msg
        assert not graph.capturing
        # the backend stays usable: a clean capture on a fresh graph works
        g2 = backend.new_graph()
        y = capture(backend, g2, pool, lambda t: t + 1, x)
        x.fill_(1)
        g2.replay()
        backend.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 2.0))
        assert x.tolist() == [1.0] * 8  # host conversions work again outside capture
        g2.reset()
        pool.close()

    def test_pool_reports_and_closes(self, backend: Backend) -> None:
        dev = backend.device
        x = torch.randn(256, 256, device=dev)
        graph, pool = backend.new_graph(), backend.new_pool()
        capture(backend, graph, pool, lambda t: (t @ t).relu(), x)
        assert pool.reserved_bytes() >= 256 * 256 * 4
        graph.reset()
        pool.close()


class VirtualMemoryTests(BackendTests):
    """VirtualMemory: reserve, create, map whole chunks, alias with data, tear down clean."""

    @pytest.fixture
    def vm(self, backend: Backend):
        vm = backend.virtual_memory()
        if vm is None:
            pytest.skip(f"backend {backend.name!r} has no virtual memory")
        return vm

    def test_granularity(self, vm) -> None:
        assert vm.granularity > 0 and vm.granularity % 4096 == 0

    def test_one_chunk_at_two_addresses_aliases(self, backend: Backend, vm) -> None:
        g = vm.granularity
        a, b = vm.reserve(2 * g), vm.reserve(2 * g)
        chunk = vm.create(g)
        vm.map(a, chunk)
        vm.map(b + g, chunk)
        ta, tb = backend.as_tensor(a, g), backend.as_tensor(b + g, g)
        pattern = torch.randint(0, 255, (g,), dtype=torch.uint8)
        ta.copy_(pattern.to(ta.device))
        backend.synchronize()
        assert torch.equal(tb.cpu(), pattern)
        tb[:16].fill_(7)
        backend.synchronize()
        assert torch.equal(ta[:16].cpu(), torch.full((16,), 7, dtype=torch.uint8))
        del ta, tb
        vm.unmap(a)
        vm.unmap(b + g)
        vm.free(chunk)
        vm.release(a)
        vm.release(b)

    def test_unmap_keeps_reservation_for_another_chunk(self, backend: Backend, vm) -> None:
        g = vm.granularity
        a = vm.reserve(g)
        c1, c2 = vm.create(g), vm.create(g)
        vm.map(a, c1)
        backend.as_tensor(a, g).fill_(1)
        vm.unmap(a)
        vm.map(a, c2)
        t = backend.as_tensor(a, g)
        t.fill_(2)
        vm.unmap(a)
        vm.map(a, c1)  # c1 kept its data while unmapped
        backend.synchronize()
        assert int(backend.as_tensor(a, g)[:64].cpu().max()) == 1
        vm.unmap(a)
        vm.free(c1)
        vm.free(c2)
        vm.release(a)

    def test_bad_sizes_and_addresses_raise(self, vm) -> None:
        g = vm.granularity
        with pytest.raises(VirtualMemoryError):
            vm.create(g + 1)
        a = vm.reserve(2 * g)
        chunk = vm.create(g)
        with pytest.raises(VirtualMemoryError):
            vm.map(a + g // 2, chunk)  # misaligned
        with pytest.raises(VirtualMemoryError):
            vm.unmap(a)  # nothing mapped there
        vm.free(chunk)
        vm.release(a)

    def test_teardown_returns_memory(self, backend: Backend, vm) -> None:
        g = vm.granularity
        n = max(8, (16 << 20) // g)
        before = backend.memory_in_use()
        if before is None:
            pytest.skip("backend reports no memory in use")
        a = vm.reserve(n * g)
        chunks = [vm.create(g) for _ in range(n)]
        for i, c in enumerate(chunks):
            vm.map(a + i * g, c)
            backend.as_tensor(a + i * g, g).fill_(1)  # touch, so host pages are resident
        backend.synchronize()
        during = backend.memory_in_use()
        for i in range(n):
            vm.unmap(a + i * g)
        for c in chunks:
            vm.free(c)
        vm.release(a)
        backend.synchronize()
        after = backend.memory_in_use()
        assert during is not None and after is not None
        assert during - before >= n * g * 0.9
        assert after - before < n * g * 0.1, (before, during, after)


class PluginTests(BackendTests):
    """Discovery and selection: listed, selectable by name and by XGRAPH_BACKEND, complete."""

    def test_listed_as_available(self, backend: Backend) -> None:
        info = {b.name: b for b in xgraph.list_backends()}
        assert backend.name in info
        assert info[backend.name].available, info[backend.name].reason

    def test_selected_by_name_is_one_object(self, backend: Backend) -> None:
        assert xgraph.get_backend(backend.name) is backend
        assert isinstance(backend, Backend)
        type(backend).check_complete()

    def test_selected_by_environment(self, backend: Backend, monkeypatch) -> None:
        monkeypatch.setenv("XGRAPH_BACKEND", backend.name)
        assert xgraph.get_backend() is backend

    def test_unknown_name_names_the_available_ones(self, backend: Backend) -> None:
        with pytest.raises(xgraph.BackendNotFoundError) as info:
            xgraph.get_backend("no-such-backend")
        msg = str(info.value)
        assert "'no-such-backend'" in msg and repr(backend.name) in msg and "XGRAPH_BACKEND" in msg


class ConformanceSuite(PluginTests, GraphTests, VirtualMemoryTests):
    """Every conformance test; subclass it once per backend."""
