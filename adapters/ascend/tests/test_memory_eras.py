"""Graph memory on the simulated NPU in both torch_npu memory-pool eras.

Owner era (torch_npu >= 2.13): shared-physical over aclrt VMM through SharedPhysicalPool,
max of shapes in any capture order. MemPoolContext era (torch_npu <= 2.12): the backend
says shared-physical is unavailable and GraphMemory falls back to shared-pool with one
warning; the simulator shows the hazard that makes the adapter refuse it.
"""

from __future__ import annotations

import ctypes
import random
import warnings

import pytest
import torch

from xgraph import GraphExecutor, GraphMemory, Input, XGraphError, XGraphWarning
from xgraph.pool import SharedPhysicalPool
from xgraph.routing import callback_pointers, routing

SIZES = [64, 128, 256, 512, 1024]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128)
    ).eval()


def _executor(backend, memory, order, mlp):  # type: ignore[no-untyped-def]
    ex = GraphExecutor(
        lambda x: mlp(x),
        backend=backend,
        buckets=SIZES,
        memory=memory,
        inputs=[Input("x", torch.float32, ("num_tokens", 128))],
    )
    for n in order:
        ex(x=torch.randn(n, 128))
    return ex


def _alone_bytes(make_sim, mlp) -> int:  # type: ignore[no-untyped-def]
    backend = make_sim()
    mem = GraphMemory(backend, "shared-physical")
    _executor(backend, mem, [max(SIZES)], mlp).close()
    alone = mem.graph_bytes()
    mem.close()
    return alone


@pytest.mark.parametrize("order", ["ascending", "random", "largest-first"])
def test_shared_physical_is_the_largest_alone_in_any_order(make_sim, order) -> None:  # type: ignore[no-untyped-def]
    mlp = _mlp()
    alone = _alone_bytes(make_sim, mlp)
    seq = {
        "ascending": sorted(SIZES),
        "largest-first": sorted(SIZES, reverse=True),
        "random": random.Random(3).sample(SIZES, len(SIZES)),
    }[order]
    backend = make_sim()
    rt = backend.runtime
    mem = GraphMemory(backend)  # the default where the backend has VMM
    assert mem.mode.value == "shared-physical"
    ex = _executor(backend, mem, seq, mlp)
    chunk = mem.physical.chunk_size  # type: ignore[union-attr]
    assert chunk == 2 << 20  # the aclrt granularity
    assert alone >= 2 * chunk  # several chunks: max against sum is a real difference
    assert mem.graph_bytes() <= alone + chunk, (order, mem.graph_bytes(), alone)
    stats = mem.stats()["physical"]
    assert stats["spaces"] == len(SIZES) and stats["map_calls"] > stats["chunks"]
    # the simulator's books agree: one handle per chunk, mapped once per space that uses it,
    # and one for the executor's persistent input buffer (xgraph.arena: sleep gives it back)
    books, buffer = rt.books(), len(ex.arena.segments.segments)
    assert buffer == 1
    assert books["handles"] == stats["chunks"] + 1 and books["reservations"] == len(SIZES) + 1
    for n in random.Random(1).choices(SIZES, k=6):  # replays in random order, new values
        x = torch.randn(n, 128)
        with torch.no_grad():
            assert torch.equal(ex(x=x), mlp(x))
    ex.close()
    mem.close()
    assert rt.books() == dict.fromkeys(books, 0)


def test_each_capture_reserves_the_devices_memory(make_sim) -> None:  # type: ignore[no-untyped-def]
    """capture_space_bytes is the runtime's total memory (mem_get_info), not a fixed 64 GiB:
    a shared-physical capture can never use more, and the VA budget is the driver's."""
    capacity = 6 << 30
    backend = make_sim(capacity=capacity)
    rt = backend.runtime
    assert backend.capture_space_bytes() == capacity == rt.mem_get_info()[1]
    mem = GraphMemory(backend, "shared-physical")
    ex = _executor(backend, mem, [64, 256], _mlp())
    assert rt.mem_get_info()[1] == capacity and rt.mem_get_info()[0] < capacity
    assert mem.physical.space_bytes == capacity  # type: ignore[union-attr]
    buffers = [size for _, size in ex.arena.segments.ranges()]  # the persistent buffers'
    assert buffers and max(buffers) < capacity
    # one per capture, besides the buffers' own
    assert sorted(rt.lib.reservation_sizes()) == sorted([capacity, capacity, *buffers])
    ex.close()
    mem.close()
    assert rt.lib.reservation_sizes() == []


def test_on_torch_npu_the_space_is_the_npus_memory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """TorchNpuRuntime reads torch.npu.mem_get_info(device): the NPU's HBM (a stand-in of
    torch.npu here, the call's shape: (free, total) bytes)."""
    import types

    from xgraph_ascend.backend import AscendBackend
    from xgraph_ascend.runtime import TorchNpuRuntime

    asked = []
    hbm = 64 << 30

    def mem_get_info(device):  # type: ignore[no-untyped-def]
        asked.append(device)
        return 3 << 30, hbm

    monkeypatch.setattr(
        torch, "npu", types.SimpleNamespace(mem_get_info=mem_get_info), raising=False
    )
    rt = TorchNpuRuntime.__new__(TorchNpuRuntime)  # no torch_npu here: only what the call reads
    rt.device = torch.device("cpu")
    backend = AscendBackend(rt)
    assert backend.capture_space_bytes() == hbm and backend.memory_in_use() == hbm - (3 << 30)
    assert asked == [rt.device, rt.device]


def test_private_memory_grows_as_the_sum(make_sim) -> None:  # type: ignore[no-untyped-def]
    mlp = _mlp()
    alone = _alone_bytes(make_sim, mlp)
    backend = make_sim()
    mem = GraphMemory(backend, "private")
    ex = _executor(backend, mem, sorted(SIZES), mlp)
    assert mem.graph_bytes() > 1.5 * alone
    ex.close()
    mem.close()


def test_context_era_falls_back_to_shared_pool_with_one_warning(make_sim, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import xgraph.memory

    monkeypatch.setattr(xgraph.memory, "_warned", set())  # the core warns once per process
    backend = make_sim(era="context")
    support = backend.segments_support()
    assert not support.available and "MemPoolContext" in support.reason
    assert "aclrtFree" in support.reason and "2.13" in support.reason
    mlp = _mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mem = GraphMemory(backend)
        mem2 = GraphMemory(backend)
    ours = [c for c in caught if issubclass(c.category, XGraphWarning)]
    assert len(ours) == 1 and "shared-pool" in str(ours[0].message)
    assert "MemPoolContext" in str(ours[0].message)
    assert mem.mode.value == "shared-pool" and mem2.mode.value == "shared-pool"
    ex = _executor(backend, mem, sorted(SIZES, reverse=True), mlp)
    for n in (64, 1024, 256):
        x = torch.randn(n, 128)
        with torch.no_grad():
            assert torch.equal(ex(x=x), mlp(x))
    ex.close()
    mem.close()
    mem2.close()
    with pytest.raises(XGraphError, match="Routed capture pools are refused"):
        backend.new_pool(segments=SharedPhysicalPool(backend.virtual_memory()).new_space())
    assert backend.runtime.lib.violations == []


def test_context_era_hazard_is_what_the_simulator_shows(make_sim) -> None:  # type: ignore[no-untyped-def]
    """Why the fallback: a routed pool's segments are freed with aclrtFree on VMM addresses."""
    backend = make_sim(era="context")
    rt = backend.runtime
    physical = SharedPhysicalPool(backend.virtual_memory())
    space = physical.new_space()
    mempool = rt.new_mempool(rt.custom_allocator(*callback_pointers()))
    graph, side = rt.new_graph(), rt.new_stream()
    x = torch.randn(512, 512)
    with rt.use_stream(side), routing(space), rt.mempool_context(mempool):
        graph.capture_begin(pool=mempool.id, capture_error_mode="thread_local")
        y = x @ x
        graph.capture_end()
    assert space.base <= y.data_ptr() < space.base + space.size  # the segment was routed
    del y
    graph.reset()
    del mempool  # the pool empties: its segments go to the bare aclrtFree
    assert any("VMM reservation" in v for v in rt.lib.violations), rt.lib.violations
    physical.close()
    assert ctypes.sizeof(ctypes.c_void_p) == 8
