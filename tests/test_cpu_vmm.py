"""The CPU backend's memfd VirtualMemory: aliasing with data, and resident memory of aliases."""

from __future__ import annotations

import pytest
import torch

import xgraph
from xgraph.backends.cpu.vmm import (
    HostVirtualMemory,
    proportional_resident_bytes,
    resident_bytes,
)


@pytest.fixture
def vm():
    return HostVirtualMemory(granularity=64 * 1024)


def test_chunk_at_two_addresses_reads_what_the_other_wrote(cpu, vm):
    g = vm.granularity
    a, b = vm.reserve(g), vm.reserve(g)
    chunk = vm.create(g)
    vm.map(a, chunk)
    vm.map(b, chunk)
    ta, tb = cpu.as_tensor(a, g), cpu.as_tensor(b, g)
    data = torch.randint(0, 256, (g,), dtype=torch.uint8)
    ta.copy_(data)
    assert torch.equal(tb, data)
    tb.view(torch.float32)[:4] = torch.tensor([1.5, -2.0, 3.25, 0.0])
    assert ta.view(torch.float32)[:4].tolist() == [1.5, -2.0, 3.25, 0.0]
    del ta, tb
    for addr in (a, b):
        vm.unmap(addr)
        vm.release(addr)
    vm.free(chunk)
    assert vm.live() == {"reservations": 0, "mappings": 0, "chunks": 0}


def test_n_mappings_cost_one_chunk_of_resident_memory(cpu, vm):
    """Pss (the kernel's proportional resident size) grows by one chunk, not N.

    VmRSS counts a shared page once per mapping, so it grows N times; the memfd's own block
    count and Pss both show the single physical copy. All three are measured and reported.
    """
    n, size = 8, 16 << 20
    vm16 = HostVirtualMemory(granularity=size)
    chunk = vm16.create(size)
    base = vm16.reserve(n * size)
    pss0, rss0, phys0 = proportional_resident_bytes(), resident_bytes(), vm16.backed_bytes()
    for i in range(n):
        vm16.map(base + i * size, chunk)
        cpu.as_tensor(base + i * size, size).fill_(i + 1)  # touch every page through every alias
    pss1, rss1, phys1 = proportional_resident_bytes(), resident_bytes(), vm16.backed_bytes()
    assert int(cpu.as_tensor(base, size)[-1]) == n  # all N addresses show the last write
    print(
        f"\n{n} mappings of one {size >> 20} MiB chunk: Pss +{(pss1 - pss0) >> 20} MiB, "
        f"memfd +{(phys1 - phys0) >> 20} MiB, VmRSS +{(rss1 - rss0) >> 20} MiB"
    )
    assert phys1 - phys0 == size
    assert size * 0.9 <= pss1 - pss0 <= size * 1.25
    assert rss1 - rss0 >= (n - 1) * size  # the per-mapping count, for contrast
    for i in range(n):
        vm16.unmap(base + i * size)
    vm16.release(base)
    vm16.free(chunk)
    assert vm16.backed_bytes() == phys0
    assert proportional_resident_bytes() - pss0 < size * 0.25


def test_contract_violations_raise(vm):
    g = vm.granularity
    a = vm.reserve(2 * g)
    c = vm.create(g)
    vm.map(a, c)
    with pytest.raises(xgraph.VirtualMemoryError, match="overlaps"):
        vm.map(a, vm.create(g))
    with pytest.raises(xgraph.VirtualMemoryError, match="still mapped"):
        vm.free(c)
    with pytest.raises(xgraph.VirtualMemoryError, match="still mapped"):
        vm.release(a)
    with pytest.raises(xgraph.VirtualMemoryError, match="not inside a reservation"):
        vm.map(a + 4 * g, c)
    with pytest.raises(xgraph.VirtualMemoryError, match="multiple of the granularity"):
        vm.reserve(g + 4096)
    vm.unmap(a)
    vm.free(c)
    vm.release(a)
