"""The CPU backend's memfd VirtualMemory: aliasing with data, and resident memory of aliases."""

from __future__ import annotations

import pytest
import torch

import xgraph
from xgraph.backends.cpu.vmm import HostVirtualMemory, range_resident_bytes


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
    """The N mappings of one chunk hold one chunk of memory: Pss (the kernel's proportional
    resident size) sums to one chunk over them, Rss to N chunks, and the memfd backs one.

    Each reading covers only the mappings under test (their /proc/self/smaps entries and the
    memfd's own blocks), so nothing else, in this process or another, can move it.
    """
    n, size = 8, 16 << 20
    vm16 = HostVirtualMemory(granularity=size)
    chunk = vm16.create(size)
    base = vm16.reserve(n * size)
    end = base + n * size
    assert range_resident_bytes(base, end) == (0, 0) and vm16.backed_bytes() == 0
    for i in range(n):
        vm16.map(base + i * size, chunk)
        cpu.as_tensor(base + i * size, size).fill_(i + 1)  # touch every page through every alias
    rss, pss = range_resident_bytes(base, end)
    assert int(cpu.as_tensor(base, size)[-1]) == n  # all N addresses show the last write
    print(
        f"\n{n} mappings of one {size >> 20} MiB chunk: Pss {pss / 2**20:.2f} MiB, "
        f"memfd {vm16.backed_bytes() >> 20} MiB, Rss {rss >> 20} MiB"
    )
    assert vm16.backed_bytes() == size
    assert abs(pss - size) <= n * 4096  # one copy; smaps rounds each mapping's Pss to a KiB
    assert rss == n * size  # the per-mapping count, for contrast
    for i in range(n):
        vm16.unmap(base + i * size)
    assert range_resident_bytes(base, end) == (0, 0)  # placeholders hold nothing
    vm16.release(base)
    vm16.free(chunk)
    assert vm16.backed_bytes() == 0


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
