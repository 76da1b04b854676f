"""Conformance of VirtualMemory: whole-chunk maps, aliasing with data, teardown."""

from __future__ import annotations

import pytest
import torch

from xgraph.errors import VirtualMemoryError
from xgraph.interfaces import Backend

from .base import VirtualMemoryFixture


class VirtualMemoryTests(VirtualMemoryFixture):
    """VirtualMemory: reserve, create, map whole chunks, alias with data, tear down clean."""

    def test_granularity(self, vm) -> None:
        if vm is None:
            return  # the fixture checked the documented absence
        assert vm.granularity > 0 and vm.granularity % 4096 == 0

    def test_one_chunk_at_two_addresses_aliases(self, backend: Backend, vm) -> None:
        if vm is None:
            return  # the fixture checked the documented absence
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
        if vm is None:
            return  # the fixture checked the documented absence
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
        if vm is None:
            return  # the fixture checked the documented absence
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

    def test_teardown_returns_memory(self, backend: Backend, vm, reports_memory: bool) -> None:
        """By the driver's reading where the backend has one, and by the books always."""
        if vm is None:
            return  # the fixture checked the documented absence
        g = vm.granularity
        n = max(8, (16 << 20) // g)
        books = vm.live()
        before = backend.memory_in_use()
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
        assert vm.live() == books
        assert (before is not None) == reports_memory
        if reports_memory:
            assert during is not None and after is not None
            assert during - before >= n * g * 0.9
            assert after - before < n * g * 0.1, (before, during, after)
