"""Conformance of SharedPhysicalPool over the backend's VMM."""

from __future__ import annotations

import torch

from xgraph.interfaces import Backend

from .base import VirtualMemoryFixture


class PoolTests(VirtualMemoryFixture):
    """SharedPhysicalPool on this backend's VMM: aliasing across spaces, max not sum, teardown."""

    def test_two_spaces_alias_one_chunk_with_data(self, backend: Backend, vm) -> None:  # type: ignore[no-untyped-def]
        if vm is None:
            return  # the fixture checked the documented absence
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
        if vm is None:
            return  # the fixture checked the documented absence
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

    def _mlp(self, backend: Backend) -> torch.nn.Module:
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
        )
        return mlp.to(backend.device).eval()

    def _falls_back_to_shared_pool(self, backend: Backend) -> None:
        """Where pools cannot route segments: shared-physical becomes shared-pool, warned."""
        import warnings

        from xgraph import GraphMemory, XGraphWarning
        from xgraph import memory as core_memory

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            core_memory._warned.clear()  # warned once per process: this test wants to see it
            mem = GraphMemory(backend, "shared-physical")
        assert mem.mode.value == "shared-pool"
        assert any(issubclass(c.category, XGraphWarning) for c in caught)
        mlp, sizes = self._mlp(backend), [256, 64, 128]
        ex = self._capture_sizes(backend, mem, sizes, mlp)
        for n in sizes:
            x = torch.randn(n, 256)
            with torch.no_grad():
                self.assert_matches(backend, ex(x=x), mlp(x.to(backend.device)))
        ex.close()
        mem.close()

    def test_shared_physical_is_max_in_any_order_and_replays_match(
        self, backend: Backend, vm, routes_segments: bool
    ) -> None:
        """Where pools cannot route segments, the documented fallback instead."""
        if vm is None:
            return  # the fixture checked the documented absence
        if not routes_segments:
            return self._falls_back_to_shared_pool(backend)
        import random

        from xgraph import GraphMemory

        dev = backend.device
        mlp = self._mlp(backend)
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

    def test_close_returns_memory_to_baseline(  # type: ignore[no-untyped-def]
        self, backend: Backend, vm, reports_memory: bool
    ) -> None:
        """By the driver's reading where the backend has one, and by the books always."""
        if vm is None:
            return  # the fixture checked the documented absence
        import gc

        from xgraph.pool import SharedPhysicalPool

        # garbage of earlier tests freed now, not between the readings (on the host the
        # reading is the whole process's resident memory)
        warm = SharedPhysicalPool(vm)  # one round first: what the first one loads lazily
        space = warm.new_space()
        backend.as_tensor(space.alloc(warm.chunk_size), warm.chunk_size).fill_(3)
        backend.synchronize()
        warm.close()
        gc.collect()
        books, before = vm.live(), backend.memory_in_use()
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
        assert vm.live() == books
        if reports_memory:
            assert before is not None and during is not None and after is not None
            assert during - before >= 0.9 * n  # four spaces, one copy of physical memory
            assert during - before < 2 * n
            assert after - before < 0.1 * n, (before, during, after)
