"""Injected ACL failures: each raises the named xgraph error, leaves the simulator's books as
they were (no handle, mapping, range, model RI or pool routing leaked), and the executor
keeps serving its other keys."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import xgraph
from xgraph import CaptureError, GraphExecutor, Input, VirtualMemoryError, XGraphWarning
from xgraph.pool import SharedPhysicalPool

SIZES = [64, 256, 1024]


def _executor(backend, on_error: str = "raise"):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128)
    ).eval()
    ex = GraphExecutor(
        lambda x: mlp(x),
        backend=backend,
        buckets=SIZES,
        on_capture_error=on_error,
        inputs=[Input("x", torch.float32, ("num_tokens", 128))],
    )
    ex(x=torch.randn(64, 128))  # key 64 captured before any fault
    return ex, mlp


def _serves(ex, mlp, sizes) -> None:  # type: ignore[no-untyped-def]
    for n in sizes:
        x = torch.randn(n, 128)
        with torch.no_grad():
            assert torch.equal(ex(x=x), mlp(x)), n


def _keepers(backend) -> int:  # type: ignore[no-untyped-def]
    """aclmdlRICaptureEnd calls before a new key's own: the keeper of the fresh pool each
    capture gets in shared-physical memory (owner era); none in shared-pool memory (the
    MemPoolContext era's fallback), whose one pool captured its keeper at creation."""
    return 1 if backend.segments_support().available else 0


def _closed_clean(ex, rt) -> None:  # type: ignore[no-untyped-def]
    # a caught capture error's traceback (a cycle through this test's frames) holds tensors
    # of the failed capture, blocks whose segments no pool could give back while they live;
    # and views of the input buffers, whose range stays covered until they go (the callers
    # drop what they caught first)
    gc.collect()
    ex.close()
    books = rt.books()
    assert books == dict.fromkeys(books, 0), books
    assert rt.faults.pending() == {}


@pytest.mark.parametrize("call", ["aclrtMallocPhysical", "aclrtMapMem"])
def test_out_of_memory_mid_capture_names_the_vmm_call(sim, call) -> None:  # type: ignore[no-untyped-def]
    ex, mlp = _executor(sim)
    rt = sim.runtime
    before = rt.books()
    rt.faults.inject(call, 207001)
    with pytest.raises((CaptureError, VirtualMemoryError)) as info:
        ex(x=torch.randn(1024, 128))  # a new key: its capture grows the shared pool
    err = info.value if isinstance(info.value, VirtualMemoryError) else info.value.__cause__
    assert isinstance(err, VirtualMemoryError), repr(info.value)
    assert err.call == call and err.error == "ACL_ERROR_RT_MEMORY_ALLOCATION (207001)"
    assert "out of memory" in str(err)
    assert rt.books() == before  # the failed capture's range, chunks and maps are gone
    assert ex.stats()["keys"] == [("full", 64)]
    _serves(ex, mlp, [64, 1024, 256, 64])  # the key captures on retry; the others replay
    assert ex.stats()["captures"] == 3
    del info, err
    _closed_clean(ex, rt)


def test_failed_key_falls_back_to_eager_and_others_replay(sim) -> None:  # type: ignore[no-untyped-def]
    ex, mlp = _executor(sim, on_error="eager")
    rt = sim.runtime
    rt.faults.inject("aclrtMapMem", 207001)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _serves(ex, mlp, [256, 64, 1024, 256, 64])
    assert sum(issubclass(c.category, XGraphWarning) for c in caught) == 1
    s = ex.stats()
    assert "aclrtMapMem" in s["failed_keys"][("full", 256)]
    assert set(s["hits"]) == {("full", 64), ("full", 1024)} and s["hits"][("full", 64)] == 2
    assert s["eager"] == {"capture failed": 1, "capture failed earlier": 1}
    _closed_clean(ex, rt)


def test_unaligned_reservation_is_given_back(sim) -> None:  # type: ignore[no-untyped-def]
    ex, mlp = _executor(sim)
    rt = sim.runtime
    before = rt.books()
    rt.lib.misaligned_reserves = 1  # the driver hands out a range off the 2 MiB boundary
    with pytest.raises(VirtualMemoryError, match="not aligned to 2097152") as info:
        ex(x=torch.randn(256, 128))
    assert info.value.call == "aclrtReserveMemAddress"
    assert rt.books() == before
    _serves(ex, mlp, [64, 256])
    del info
    _closed_clean(ex, rt)


def test_partial_map_and_double_unmap_fail_with_the_acl_name(sim) -> None:  # type: ignore[no-untyped-def]
    vm, rt = sim.virtual_memory(), sim.runtime
    g = vm.granularity
    a, chunk = vm.reserve(2 * g), vm.create(2 * g)
    with pytest.raises(VirtualMemoryError) as info:
        vm._map_chunk(a, chunk.handle, g)  # the driver call with half the handle
    assert info.value.call == "aclrtMapMem"  # a driver check: 107000 is the simulator's code
    assert info.value.error == "ACL_ERROR_RT_PARAM_INVALID (107000)" and "whole handle" in str(
        info.value
    )
    assert rt.books()["mappings"] == 0
    vm.map(a, chunk)
    vm.unmap(a)
    with pytest.raises(VirtualMemoryError, match="nothing is mapped"):
        vm.unmap(a)  # refused by the core's books before the driver
    with pytest.raises(VirtualMemoryError) as info:
        vm._unmap_chunk(a, 2 * g)  # and by the driver itself
    assert info.value.call == "aclrtUnmapMem" and "ACL_ERROR_RT_PARAM_INVALID" in info.value.error
    vm.free(chunk)
    vm.release(a)
    assert vm.live() == {"reservations": 0, "mappings": 0, "chunks": 0}
    assert rt.books() == dict.fromkeys(rt.books(), 0)


@pytest.mark.parametrize(
    "code, name, advice",
    [
        (107025, "ACL_ERROR_RT_STREAM_UNJOINED", "joined back"),
        (207008, "ACL_ERROR_RT_NO_STREAM_RESOURCE", "capture fewer sizes"),
    ],
)
def test_capture_end_error_is_a_named_capture_error(era_sim, code, name, advice) -> None:  # type: ignore[no-untyped-def]
    sim = era_sim
    ex, mlp = _executor(sim)
    rt = sim.runtime
    before = rt.books()
    rt.faults.inject("aclmdlRICaptureEnd", code, after=_keepers(sim))
    with pytest.raises(CaptureError) as info:
        ex(x=torch.randn(256, 128))
    msg = str(info.value)
    assert f"{name} ({code})" in msg and advice in msg, msg
    del info  # its traceback holds the failed capture's tensors
    assert rt.books() == before
    _serves(ex, mlp, [64, 256, 1024])
    _closed_clean(ex, rt)


@pytest.mark.parametrize("fault", ["aclmdlRICaptureEnd", "capture_end_refused"])
def test_a_failed_capture_end_leaves_no_stream_capturing(era_sim, fault) -> None:  # type: ignore[no-untyped-def]
    """ACL takes the stream out of capture when its end fails past its status checks, so
    NPUGraph.capture_end (called once) is the only end. torch_npu refusing before ACL runs
    (its same-stream check) leaves the stream capturing: the adapter ends it through
    aclmdlRICaptureEnd. Either way later captures run on a new capture stream."""
    sim = era_sim
    ex, mlp = _executor(sim)
    rt = sim.runtime
    before, old = rt.books(), sim.capture_stream()
    keepers = _keepers(sim)
    rt.faults.inject(fault, 107025, after=keepers)
    calls = rt.faults.calls["aclmdlRICaptureEnd"]
    with pytest.raises(CaptureError, match="ACL_ERROR_RT_STREAM_UNJOINED"):
        ex(x=torch.randn(256, 128))
    # the keeper's; then NPUGraph's, which ended it, or (refused before ACL) the adapter's
    assert rt.faults.calls["aclmdlRICaptureEnd"] - calls == keepers + 1
    assert not rt.is_capturing(old) and sim.capture_stream() is not old
    assert rt.books() == before
    _serves(ex, mlp, [256, 64])
    _closed_clean(ex, rt)


def test_an_end_acl_fails_too_still_leaves_no_stream_capturing(era_sim, caplog) -> None:  # type: ignore[no-untyped-def]
    """torch_npu refuses the end and the adapter's own aclmdlRICaptureEnd fails too: ACL
    took the stream out of capture all the same, so nothing warns of a stream left
    capturing, and the key's retry captures on a new stream and replays."""
    sim = era_sim
    ex, mlp = _executor(sim, on_error="eager")
    rt, old = sim.runtime, sim.capture_stream()
    rt.faults.inject("capture_end_refused", 107025, after=_keepers(sim))
    rt.faults.inject("aclmdlRICaptureEnd", 507899, after=_keepers(sim))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _serves(ex, mlp, [256])  # fails, runs eagerly
    assert not rt.is_capturing(old) and sim.capture_stream() is not old
    assert "could not be ended" not in caplog.text
    sim.synchronize()  # a device synchronize: no stream captures
    _serves(ex, mlp, [1024, 64, 1024])  # captured on the new stream, replayed
    assert set(ex.stats()["hits"]) == {("full", 64), ("full", 1024)}
    _closed_clean(ex, rt)


def test_failed_capture_begin_undoes_torch_npus_early_routing(era_sim) -> None:  # type: ignore[no-untyped-def]
    sim = era_sim
    ex, mlp = _executor(sim)
    rt = sim.runtime
    rt.faults.inject("aclmdlRICaptureBegin", 207008, after=_keepers(sim))
    with pytest.raises(CaptureError, match="capture fewer sizes"):
        ex(x=torch.randn(256, 128))
    assert rt.books()["routes"] == 0
    _serves(ex, mlp, [256, 64])
    _closed_clean(ex, rt)


def test_synchronize_inside_capture_is_stream_captured(era_sim) -> None:  # type: ignore[no-untyped-def]
    """A device synchronize while a stream captures fails with 107027 (hicann/runtime
    context.cc: RT_ERROR_STREAM_CAPTURED); 107030 is for synchronous copies and memsets."""
    sim = era_sim
    x = torch.ones(8)
    graph, pool = sim.new_graph(), sim.new_pool()
    with pytest.raises(CaptureError) as info:
        with xgraph.graph(graph, pool):
            x + 1
            sim.synchronize()
    pool.close()
    msg = str(info.value)
    assert "ACL_ERROR_RT_STREAM_CAPTURED (107027)" in msg, msg
    assert "in every capture mode and from every thread" in msg, msg


def test_synchronize_inside_capture_is_refused_and_rolled_back(era_sim) -> None:  # type: ignore[no-untyped-def]
    sim = era_sim
    rt = sim.runtime
    x = torch.ones(8)
    graph, pool = sim.new_graph(), sim.new_pool()
    with pytest.raises(CaptureError, match="ACL_ERROR_RT_STREAM_CAPTURED"):
        with xgraph.graph(graph, pool):
            x + 1
            sim.synchronize()
    # the keeper's use, and the MemPool's in the owner era (none in the MemPoolContext era)
    owner = sim.segments_support().available
    assert rt.books()["routes"] == 0 and rt.caching.use_count(pool.id) == 1 + owner
    with xgraph.graph(graph, pool):
        y = x * 3
    x.fill_(2)
    graph.replay()
    assert torch.equal(y, torch.full((8,), 6.0))
    graph.reset()
    del y  # a live block keeps its segment, as on an NPU
    pool.close()
    assert rt.books() == dict.fromkeys(rt.books(), 0)


def test_a_route_left_behind_is_caught_by_the_simulator(make_sim) -> None:  # type: ignore[no-untyped-def]
    """The books' 'routes' check can fail: without the adapter's undo the next capture breaks."""
    rt = make_sim().runtime
    mempool, side = rt.new_mempool(None), rt.new_stream()
    rt.faults.inject("aclmdlRICaptureBegin", 107000)
    with rt.use_stream(side):
        with pytest.raises(RuntimeError):
            rt.new_graph().capture_begin(pool=mempool.id, capture_error_mode="thread_local")
        assert rt.books()["routes"] == 1
        with pytest.raises(RuntimeError, match="still go to pool"):
            rt.new_graph().capture_begin(pool=mempool.id, capture_error_mode="thread_local")


def test_unmap_comes_after_the_device_synchronized(make_sim) -> None:  # type: ignore[no-untyped-def]
    backend = make_sim()
    rt = backend.runtime
    ex, mlp = _executor(backend)
    _serves(ex, mlp, [256, 64])  # the last replay leaves the device busy
    ex.close()  # unmaps every space
    assert rt.lib.violations == []
    vm = backend.virtual_memory()
    a, c = vm.reserve(vm.granularity), vm.create(vm.granularity)
    vm.map(a, c)
    rt.mark_busy()  # a replay still queued
    vm.unmap(a)  # the device is synchronized before aclrtUnmapMem (CheckedVirtualMemory)
    assert rt.lib.violations == []
    vm.map(a, c)
    rt.mark_busy()  # the check can fail: an unmap with work still queued
    assert rt.acl.aclrtUnmapMem(a) == 0
    assert len(rt.lib.violations) == 1 and "synchronize" in rt.lib.violations[0]


def test_graph_level_capture_names_the_vmm_call(sim) -> None:  # type: ignore[no-untyped-def]
    """Outside an executor too: the op's out-of-memory error becomes the VMM call's error."""
    rt = sim.runtime
    physical = SharedPhysicalPool(sim.virtual_memory())
    space = physical.new_space()
    graph, pool = sim.new_graph(), sim.new_pool(segments=space)
    x = torch.randn(256, 256)
    rt.faults.inject("aclrtMallocPhysical", 207001)
    with pytest.raises(VirtualMemoryError, match="during capture") as info:
        with xgraph.graph(graph, pool):
            x @ x
    assert info.value.call == "aclrtMallocPhysical" and "ACL_ERROR_RT_MEMORY_ALLOCATION" in str(
        info.value
    )
    assert rt.books()["routes"] == 0 and rt.books()["model_ris"] == 1  # the pool's keeper
    pool.close()
    physical.close()
    assert rt.books() == dict.fromkeys(rt.books(), 0)
