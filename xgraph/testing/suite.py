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


def _tiny_workload(backend: Backend, **kw):  # type: ignore[no-untyped-def]
    from .workloads import Workload

    w = Workload.tiny(device=backend.device, **kw)
    return w


class ExecutorTests(BackendTests):
    """GraphExecutor on this backend: decode as full graphs equals eager on the padded batch."""

    buckets: ClassVar[list[int]] = [1, 2, 4, 8, 16]

    def test_decode_steps_match_padded_eager(self, backend: Backend) -> None:
        import random

        from xgraph.buckets import Buckets

        ex_w, ref_w = (
            _tiny_workload(backend, num_blocks=160, max_blocks=6, max_seqs=24) for _ in range(2)
        )
        for w in (ex_w, ref_w):
            w.randomize_cache(7)
        buckets = Buckets(self.buckets)
        ex = ex_w.executor(backend=backend, buckets=buckets)
        rng = random.Random(7)
        for batch in [3, 1, 16, 5, 20, 8, 3, 12, 2, 7, 1, 16]:
            step = ex_w.decode_step(rng, batch)
            out = ex(**step.kwargs())
            ref = step if batch > buckets.max else ref_w.padded(step, buckets, full=True)
            self.assert_matches(backend, out, ref_w.eager(ref)[:batch])
            for a, b in zip(ex_w.cache.tensors(), ref_w.cache.tensors()):
                self.assert_matches(backend, a, b)
        s = ex.stats()
        assert s["captures"] == len(self.buckets) and s["eager"] == {"above largest bucket": 1}
        assert s["replays"] == 11 and s["graph_bytes"] > 0
        ex.close()

    def test_capture_failure_on_one_key_falls_back_and_others_replay(
        self, backend: Backend
    ) -> None:
        import random
        import warnings

        from xgraph.executor import XGraphWarning

        w = _tiny_workload(backend, max_blocks=4, max_seqs=24)

        def forward(input_ids, positions):  # type: ignore[no-untyped-def]
            h = w.model.forward_logits(input_ids, positions)
            if input_ids.shape[0] == 4:
                h = h * (h[0, 0].item() != 1e9)  # host read on this bucket only
            return h

        ex = w.executor(forward, backend=backend, buckets=self.buckets)
        rng = random.Random(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in [3, 1, 4, 8, 3, 2]:
                step = w.decode_step(rng, batch)
                ex(**step.kwargs())
        assert sum(issubclass(c.category, XGraphWarning) for c in caught) == 1
        s = ex.stats()
        assert ("full", 4) in s["eager_keys"] and "item()" in s["eager_keys"][("full", 4)]
        assert set(s["hits"]) == {("full", 1), ("full", 2), ("full", 8)}
        assert s["eager"] == {"capture failed": 1, "capture failed earlier": 2}
        ex.close()

    def test_composite_key_dims_get_their_own_graphs(self, backend: Backend) -> None:
        from xgraph import Dim, GraphExecutor, Input

        dev = backend.device
        w = torch.randn(8, 8, device=dev)

        def forward(x, comm):  # type: ignore[no-untyped-def]
            return x @ w + comm.sum(0, keepdim=True)

        ex = GraphExecutor(
            forward,
            backend=backend,
            buckets=[1, 2, 4],
            inputs=[
                Input("x", torch.float32, ("num_tokens", 8)),
                Input("comm", torch.float32, ("num_comm_tokens", 8)),
            ],
            dims=[Dim("num_comm_tokens", max=32, buckets=[8, 16, 32])],
        )
        x = torch.randn(3, 8)
        for c in (5, 12, 7, 30):
            comm = torch.randn(c, 8)
            out = ex(x=x, comm=comm)
            # padding adds zero rows to the sum: equal up to summation order
            torch.testing.assert_close(out, forward(x.to(dev), comm.to(dev)), rtol=1e-5, atol=1e-5)
        assert ex.stats()["keys"] == [("full", 4, 16), ("full", 4, 32), ("full", 4, 8)]
        ex.close()


class PoolTests(BackendTests):
    """SharedPhysicalPool on this backend's VMM: aliasing across spaces, max not sum, teardown."""

    @pytest.fixture
    def vm(self, backend: Backend):  # type: ignore[no-untyped-def]
        vm = backend.virtual_memory()
        if vm is None:
            pytest.skip(f"backend {backend.name!r} has no virtual memory")
        return vm

    def test_two_spaces_alias_one_chunk_with_data(self, backend: Backend, vm) -> None:  # type: ignore[no-untyped-def]
        from xgraph.pool import SharedPhysicalPool

        with SharedPhysicalPool(vm) as pool:
            s1, s2 = pool.new_space(), pool.new_space()
            n = pool.chunk_size
            a1, a2 = s1.alloc(n), s2.alloc(n)
            assert a1 != a2 and pool.physical_bytes == n
            t1, t2 = backend.as_tensor(a1, n), backend.as_tensor(a2, n)
            data = torch.randint(0, 256, (n,), dtype=torch.uint8)
            t1.copy_(data.to(t1.device))
            backend.synchronize()
            assert torch.equal(t2.cpu(), data)
            del t1, t2

    def test_failed_capture_space_is_rolled_back(self, vm) -> None:  # type: ignore[no-untyped-def]
        from xgraph.pool import SharedPhysicalPool

        with SharedPhysicalPool(vm) as pool:
            pool.new_space().alloc(2 * pool.chunk_size)
            before = pool.stats()
            space = pool.new_space()
            space.alloc(5 * pool.chunk_size)
            assert pool.physical_bytes == 5 * pool.chunk_size
            pool.discard(space)
            after = pool.stats()
            assert {
                k: after[k]
                for k in ("physical_bytes", "chunks", "spaces", "high_water_bytes", "virtual_bytes")
            } == {
                k: before[k]
                for k in ("physical_bytes", "chunks", "spaces", "high_water_bytes", "virtual_bytes")
            }

    def _capture_sizes(self, backend, memory, sizes, mlp):  # type: ignore[no-untyped-def]
        from xgraph import GraphExecutor, Input

        ex = GraphExecutor(
            lambda x: mlp(x),
            backend=backend,
            buckets=sorted(set(sizes)),
            memory=memory,
            inputs=[Input("x", torch.float32, ("num_tokens", 256))],
        )
        for n in sizes:
            ex(x=torch.randn(n, 256))
        return ex

    def test_shared_physical_is_max_in_any_order_and_replays_match(
        self, backend: Backend, vm
    ) -> None:
        import random

        from xgraph import GraphMemory

        dev = backend.device
        torch.manual_seed(0)
        mlp = (
            torch.nn.Sequential(
                torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
            )
            .to(dev)
            .eval()
        )
        sizes = [64, 128, 256, 512, 1024]
        alone_mem = GraphMemory(backend, "shared-physical")
        self._capture_sizes(backend, alone_mem, [max(sizes)], mlp).close()
        limit = alone_mem.graph_bytes()
        alone_mem.close()
        chunk = alone_mem.physical.chunk_size  # type: ignore[union-attr]
        rng = random.Random(0)
        for order in (sorted(sizes), sorted(sizes, reverse=True), rng.sample(sizes, len(sizes))):
            mem = GraphMemory(backend, "shared-physical")
            ex = self._capture_sizes(backend, mem, order, mlp)
            assert mem.graph_bytes() <= limit + chunk, (order, mem.graph_bytes(), limit)
            for n in rng.choices(sizes, k=15):  # replay in random order, new values
                x = torch.randn(n, 256)
                with torch.no_grad():
                    self.assert_matches(backend, ex(x=x), mlp(x.to(dev)))
            ex.close()
            mem.close()
        private = GraphMemory(backend, "private")
        ex = self._capture_sizes(backend, private, sizes, mlp)
        assert private.graph_bytes() > 1.5 * limit  # private grows as the sum
        ex.close()
        private.close()

    def test_close_returns_memory_to_baseline(self, backend: Backend, vm) -> None:  # type: ignore[no-untyped-def]
        from xgraph.pool import SharedPhysicalPool

        before = backend.memory_in_use()
        if before is None:
            pytest.skip("backend reports no memory in use")
        pool = SharedPhysicalPool(vm)
        n = max(8 * pool.chunk_size, 32 << 20)
        for _ in range(4):
            a = pool.new_space().alloc(n)
            backend.as_tensor(a, n).fill_(3)  # touch: host pages become resident
        backend.synchronize()
        during = backend.memory_in_use()
        pool.close()
        backend.synchronize()
        after = backend.memory_in_use()
        assert during is not None and after is not None
        assert during - before >= 0.9 * n  # four spaces, one copy of physical memory
        assert during - before < 2 * n
        assert after - before < 0.1 * n, (before, during, after)


class PiecewiseTests(BackendTests):
    """Piecewise graphs: one graph per token count serves every batch composition."""

    def test_compositions_share_one_graph(self, backend: Backend) -> None:
        import random

        from xgraph import Buckets, default_sizes

        ex_w, ref_w = (
            _tiny_workload(backend, num_blocks=128, max_blocks=32, max_seqs=16) for _ in range(2)
        )
        for w in (ex_w, ref_w):
            w.randomize_cache(11)
        buckets = Buckets(default_sizes(64))
        ex = ex_w.executor(backend=backend, buckets=buckets)
        rng = random.Random(11)
        for comp in ([32, 32], [16] * 4, [8] * 8, [64], [5, 40, 19], [1, 1, 62]):
            step = ex_w.prefill_step(rng, comp, [rng.randint(0, 30) for _ in comp])
            out = ex(**step.kwargs())
            ref = ref_w.eager(ref_w.padded(step, buckets, full=False))[: step.num_tokens]
            self.assert_matches(backend, out, ref)
            for a, b in zip(ex_w.cache.tensors(), ref_w.cache.tensors()):
                self.assert_matches(backend, a, b)
        assert ex.stats()["keys"] == [("piecewise", 64)]
        layers = ex_w.model.config.num_layers
        assert ex.graph(("piecewise", 64)).describe() == ["piece", "runner"] * layers + ["piece"]
        ex.close()

    def test_bypassed_attention_is_refused(self, backend: Backend) -> None:
        import random

        from xgraph import Buckets, CaptureError, default_sizes

        w = _tiny_workload(backend, max_blocks=8, max_seqs=8)
        k_cache = w.cache.layers[0][0]

        def forward(input_ids, positions):  # type: ignore[no-untyped-def]
            return k_cache.flatten(1)[positions % 4, :4] + 1.0  # reads the cache directly

        ex = w.executor(
            forward, backend=backend, buckets=Buckets(default_sizes(16)), on_capture_error="raise"
        )
        with pytest.raises(CaptureError, match="KV cache"):
            ex(**w.prefill_step(random.Random(1), [3, 4]).kwargs())
        assert ex.stats()["keys"] == []
        ex.close()


class ConformanceSuite(
    PluginTests, GraphTests, VirtualMemoryTests, ExecutorTests, PoolTests, PiecewiseTests
):
    """Every conformance test; subclass it once per backend."""
