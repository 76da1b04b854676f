"""The simulated libascendcl and torch_npu: the documented rules are enforced through the same
ctypes prototypes as the real library, and the adapter's binding passes them."""

from __future__ import annotations

import ctypes

import pytest
import torch
from xgraph_ascend import acl
from xgraph_ascend.errors import AclRuntimeError
from xgraph_ascend.sim import SimRuntime

from xgraph import VirtualMemoryError

MB2 = 2 << 20


def test_struct_layout_and_prototypes() -> None:
    p = acl.aclrtPhysicalMemProp
    assert ctypes.sizeof(p) == 32
    offsets = {
        n: getattr(p, n).offset
        for n in ("handleType", "allocationType", "memAttr", "location", "reserve")
    }
    assert offsets == {
        "handleType": 0,
        "allocationType": 4,
        "memAttr": 8,
        "location": 12,
        "reserve": 24,
    }
    assert acl.aclrtMemLocation.type.offset == 4  # location.type at byte 16 of the prop
    prop = acl.device_memory_prop(3)
    raw = bytes(prop)
    assert raw[8:12] == (4).to_bytes(4, "little")  # ACL_HBM_MEM_HUGE
    assert raw[12:20] == (3).to_bytes(4, "little") + (1).to_bytes(4, "little")
    reserve = acl.PROTOTYPES["aclrtReserveMemAddress"]
    assert reserve._argtypes_ == (
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_uint64,
    )
    assert reserve._restype_ is ctypes.c_int


@pytest.fixture
def rt() -> SimRuntime:
    return SimRuntime()


def _reserve(rt: SimRuntime, size: int = 2 * MB2, align: int = 0, expect=None, flags: int = 0):  # type: ignore[no-untyped-def]
    va = ctypes.c_void_p()
    return rt.acl.aclrtReserveMemAddress(ctypes.byref(va), size, align, expect, flags), va.value


def _malloc(rt: SimRuntime, size: int = MB2, prop=None, flags: int = 0):  # type: ignore[no-untyped-def]
    h = ctypes.c_void_p()
    p = prop if prop is not None else acl.device_memory_prop(0)
    return rt.acl.aclrtMallocPhysical(ctypes.byref(h), size, ctypes.byref(p), flags), h.value


def _prop(**fields: int) -> acl.aclrtPhysicalMemProp:
    p = acl.device_memory_prop(0)
    for k, v in fields.items():
        if k.startswith("location_"):
            setattr(p.location, k[len("location_") :], v)
        else:
            setattr(p, k, v)
    return p


@pytest.mark.parametrize(
    "kw, code",
    [
        ({"flags": 2}, 100000),
        ({"size": 0}, 100000),
    ],
)
def test_reserve_rules(rt: SimRuntime, kw, code) -> None:  # type: ignore[no-untyped-def]
    rc, _ = _reserve(rt, **kw)
    assert rc == code and "aclrtReserveMemAddress" in rt.acl.recent_error()
    assert rt.books()["reservations"] == 0


def test_reserve_takes_what_the_acl_layer_takes(rt: SimRuntime) -> None:
    """No false strictness: flags 0 or 1, an alignment (documented as reserved, passed on
    unchecked by the acl layer: memory.cpp:1049-1056), an expectPtr (a hint), sizes rounded
    up."""
    for kw in ({"flags": 1}, {"align": MB2}, {"expect": 1 << 44}, {"size": MB2 + 4096}):
        rc, va = _reserve(rt, **kw)
        assert rc == 0 and va % MB2 == 0, kw
    assert rt.books()["reservations"] == 4
    _, h = _malloc(rt, 2 * MB2)
    # the rounded-up reservation holds a 4 MiB mapping
    assert rt.acl.aclrtMapMem(va, 2 * MB2, 0, h, 0) == 0
    assert rt.acl.aclrtUnmapMem(va) == 0 and rt.acl.aclrtFreePhysical(h) == 0


@pytest.mark.parametrize(
    "prop, size, flags, code",
    [
        (_prop(location_type=2), MB2, 0, 100000),  # UNREGISTERED
        (_prop(location_type=3), MB2, 0, 100000),  # MANAGED
        (_prop(location_id=1), MB2, 0, 107001),  # no such device
        (_prop(allocationType=1), MB2, 0, 100000),
        (_prop(handleType=2), MB2, 0, 100000),
        (None, 0, 0, 100000),
        (None, MB2, 1, 100000),
    ],
)
def test_malloc_physical_rules(rt: SimRuntime, prop, size, flags, code) -> None:  # type: ignore[no-untyped-def]
    rc, _ = _malloc(rt, size, prop, flags)
    assert rc == code and rt.books()["handles"] == 0


@pytest.mark.parametrize("attr", [4, 5, 10, 12, 13, 14, 15, 16, 17])
def test_device_memory_attributes_the_acl_layer_takes(attr: int) -> None:
    rt = SimRuntime(capacity=4 << 30)
    g = ctypes.c_size_t()
    prop = _prop(memAttr=attr)
    assert rt.acl.aclrtMemGetAllocationGranularity(ctypes.byref(prop), 0, ctypes.byref(g)) == 0
    assert g.value == (1 << 30 if attr in (10, 14, 17) else MB2)  # HUGE1G pages: 1 GiB
    rc, h = _malloc(rt, g.value, prop)
    assert rc == 0 and rt.acl.aclrtFreePhysical(h) == 0


@pytest.mark.parametrize("attr", [0, 1, 8, 9, 11, 18, 2, 3, 6, 7])
def test_device_memory_attributes_the_acl_layer_refuses(rt: SimRuntime, attr: int) -> None:
    """No handler (0, 1 and the HBM P2P values 8, 9, 11, or unknown); DDR (2, 3, 6, 7) only on
    the host."""
    rc, _ = _malloc(rt, MB2, _prop(memAttr=attr))
    assert rc == 100000 and "memAttr" in rt.acl.recent_error()
    assert rt.books()["handles"] == 0


def test_malloc_physical_passes_what_the_driver_decides(rt: SimRuntime) -> None:
    """Host and host-NUMA locations, DDR on the host, the reserve field: not the acl
    layer's to refuse. Host memory does not count against the device's."""
    free = rt.mem_get_info()[0]
    for prop in (_prop(location_type=0, memAttr=2), _prop(location_type=4), _prop(reserve=7)):
        rc, h = _malloc(rt, MB2, prop)
        assert rc == 0 and rt.acl.aclrtFreePhysical(h) == 0
    rc, host = _malloc(rt, MB2, _prop(location_type=0, memAttr=13))
    assert rc == 0 and rt.mem_get_info()[0] == free
    assert rt.acl.aclrtFreePhysical(host) == 0


def test_physical_sizes_are_rounded_up(rt: SimRuntime) -> None:
    rc, h = _malloc(rt, MB2 + 4096)
    assert rc == 0 and rt.lib.used_bytes() == 2 * MB2
    _, va = _reserve(rt, 2 * MB2)
    assert rt.acl.aclrtMapMem(va, 2 * MB2, 0, h, 0) == 107000  # the size given, not rounded
    assert rt.acl.aclrtMapMem(va, MB2 + 4096, 0, h, 0) == 0
    assert rt.acl.aclrtUnmapMem(va) == 0 and rt.acl.aclrtFreePhysical(h) == 0
    assert rt.acl.aclrtReleaseMemAddress(va) == 0
    assert rt.books() == dict.fromkeys(rt.books(), 0)


def test_map_unmap_free_release_rules(rt: SimRuntime) -> None:
    f = rt.acl
    _, va = _reserve(rt, 4 * MB2)
    _, h = _malloc(rt, 2 * MB2)
    assert f.aclrtMapMem(va, MB2, 0, h, 0) == 107000  # part of a handle (a driver check)
    assert f.aclrtMapMem(va, 2 * MB2, MB2, h, 0) == 107000  # offset (a driver check)
    assert f.aclrtMapMem(va, 2 * MB2, 0, h, 1) == 100000  # flags (the acl layer)
    assert f.aclrtMapMem(None, 2 * MB2, 0, h, 0) == 100000  # NULL
    assert f.aclrtMapMem(va + 4096, 2 * MB2, 0, h, 0) == 107008  # unaligned address
    assert f.aclrtMapMem(va + 3 * MB2, 2 * MB2, 0, h, 0) == 107000  # past the reservation
    assert f.aclrtMapMem(va, 2 * MB2, 0, h + 16, 0) == 107017  # unknown handle
    assert f.aclrtMapMem(va, 2 * MB2, 0, h, 0) == 0
    assert f.aclrtMapMem(va + MB2, 2 * MB2, 0, h, 0) == 107000  # overlaps the first map
    assert f.aclrtReleaseMemAddress(va) == 107000  # still mapped in it
    assert f.aclrtUnmapMem(va + MB2) == 107000  # not a mapping's start
    assert f.aclrtUnmapMem(va) == 0
    assert f.aclrtUnmapMem(va) == 107000  # twice
    assert f.aclrtFreePhysical(h) == 0 and f.aclrtFreePhysical(h) == 107017
    assert f.aclrtReleaseMemAddress(va) == 0
    assert rt.books() == dict.fromkeys(rt.books(), 0)


def test_free_of_a_mapped_handle_waits_for_its_last_unmap(rt: SimRuntime) -> None:
    """CANN 9: aclrtFreePhysical of a mapped handle succeeds; the memory goes at the unmap."""
    f = rt.acl
    (_, a), (_, b), (_, h) = _reserve(rt, MB2), _reserve(rt, MB2), _malloc(rt)
    assert f.aclrtMapMem(a, MB2, 0, h, 0) == 0 and f.aclrtMapMem(b, MB2, 0, h, 0) == 0
    rt.as_tensor(a, MB2)[:8].fill_(3)
    assert f.aclrtFreePhysical(h) == 0
    assert rt.books()["handles"] == 1 and rt.lib.used_bytes() == MB2  # still held
    assert int(rt.as_tensor(b, MB2)[:8].sum()) == 24  # and still readable
    assert f.aclrtFreePhysical(h) == 107017  # freed once
    assert f.aclrtMapMem(a + 0, MB2, 0, h, 0) == 107017  # a freed handle maps nowhere new
    assert f.aclrtUnmapMem(a) == 0 and rt.books()["handles"] == 1
    assert f.aclrtUnmapMem(b) == 0 and rt.books()["handles"] == 0
    assert rt.lib.used_bytes() == 0
    assert f.aclrtReleaseMemAddress(a) == 0 and f.aclrtReleaseMemAddress(b) == 0


def test_one_handle_at_two_addresses_aliases(rt: SimRuntime) -> None:
    f = rt.acl
    (_, a), (_, b), (_, h) = _reserve(rt, MB2), _reserve(rt, MB2), _malloc(rt)
    assert f.aclrtMapMem(a, MB2, 0, h, 0) == 0 and f.aclrtMapMem(b, MB2, 0, h, 0) == 0
    rt.as_tensor(a, MB2)[:64].fill_(7)
    assert torch.equal(rt.as_tensor(b, MB2)[:64], torch.full((64,), 7, dtype=torch.uint8))
    for v in (a, b):
        assert f.aclrtUnmapMem(v) == 0 and f.aclrtReleaseMemAddress(v) == 0
    assert f.aclrtFreePhysical(h) == 0


def test_capacity_and_device_memory(rt: SimRuntime) -> None:
    small = SimRuntime(capacity=4 * MB2)
    rc, h = _malloc(small, 4 * MB2)
    assert rc == 0 and _malloc(small, MB2)[0] == 207001
    assert small.mem_get_info() == (0, 4 * MB2)
    ptr = ctypes.c_void_p()
    assert small.acl.aclrtMalloc(ctypes.byref(ptr), 100, 0) == 207001
    assert small.acl.aclrtFreePhysical(h) == 0
    assert small.acl.aclrtMalloc(ctypes.byref(ptr), 100, 0) == 0
    assert small.books()["mallocs"] == 1 and small.acl.aclrtFree(ptr.value) == 0
    assert small.acl.aclrtFree(ptr.value) == 107000


def test_any_call_fails_on_demand(rt: SimRuntime, make_sim) -> None:  # type: ignore[no-untyped-def]
    rt.faults.inject("aclrtReserveMemAddress", 207000, after=1)
    assert _reserve(rt)[0] == 0
    assert _reserve(rt)[0] == 207000 and "injected" in rt.acl.recent_error()
    assert _reserve(rt)[0] == 0 and rt.faults.fired == [("aclrtReserveMemAddress", 207000)]
    vm = make_sim().virtual_memory()
    vm.runtime.faults.inject("aclrtReleaseMemAddress", 507899)
    a = vm.reserve(vm.granularity)
    with pytest.raises(VirtualMemoryError) as info:
        vm.release(a)
    assert info.value.error == "ACL_ERROR_RT_DRV_INTERNAL_ERROR (507899)"
    assert vm.live()["reservations"] == 1  # the books keep what the driver kept
    vm.release(a)
    assert vm.runtime.books()["reservations"] == 0


def test_a_refused_reservation_is_not_retried(make_sim) -> None:  # type: ignore[no-untyped-def]
    """The adapter reserves with flags 0, once. With flags 0 the acl layer answers 100000
    only for a NULL out-pointer or size 0, which no other flags value fixes (it takes 0 and 1
    alike): a refusal is the caller's error, raised as it is."""
    backend = make_sim()
    rt = backend.runtime
    vm = backend.virtual_memory()
    rt.faults.inject("aclrtReserveMemAddress", 100000)
    with pytest.raises(VirtualMemoryError) as info:
        vm.reserve(MB2)
    assert info.value.error == "ACL_ERROR_INVALID_PARAM (100000)"
    assert rt.faults.calls["aclrtReserveMemAddress"] == 1 and vm.live()["reservations"] == 0
    vm.release(vm.reserve(MB2))
    assert rt.books()["reservations"] == 0


def test_npugraph_state_rules(rt: SimRuntime) -> None:
    pool = rt.new_mempool(None)
    g = rt.new_graph()
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
    side = rt.new_stream()
    with rt.use_stream(side):
        with pytest.raises(RuntimeError, match="capture_error_mode"):
            g.capture_begin(pool=pool.id, capture_error_mode="sloppy")
        with pytest.raises(RuntimeError, match="no completed capture"):
            g.replay()
        g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        with pytest.raises(AclRuntimeError) as info:
            rt.new_graph().capture_begin(pool=pool.id)  # the stream is already capturing
        assert info.value.code == 107027
        y = x + 1
        g.capture_end()
        with pytest.raises(RuntimeError, match="create a new instance"):
            g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
    x.fill_(5)
    g.replay()
    assert torch.equal(y, torch.full((4,), 6.0))
    assert pool.use_count() == 2  # the MemPool and the graph
    g.reset()
    assert pool.use_count() == 1 and rt.books()["model_ris"] == 0


def test_default_stream_work_invalidates_a_capture(rt: SimRuntime) -> None:
    pool, side = rt.new_mempool(None), rt.new_stream()
    g = rt.new_graph()
    x = torch.ones(4)
    with rt.use_stream(side):
        g.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        with rt.use_stream(rt.streams.default):
            x + 1
        with pytest.raises(AclRuntimeError) as info:
            g.capture_end()
    assert info.value.code == 107031
    rt.end_allocate_to_pool(pool.id)  # torch_npu left the routing: the caller undoes it
    rt.release_pool(pool.id)
    g.reset()
    assert pool.use_count() == 1 and rt.books()["routes"] == 0


def test_a_libascendcl_without_vmm_means_shared_pool_memory() -> None:
    """Binding to a library that lacks the VMM symbols switches virtual memory off."""
    from xgraph_ascend.backend import AscendSimBackend

    import xgraph

    lib = acl.AclFunctions.from_library(ctypes.CDLL(None))  # the C library: no ACL symbols
    assert not lib.has(*acl.VMM_CALLS) and lib.recent_error() == ""
    rt = SimRuntime()
    rt.acl = lib
    backend = AscendSimBackend(rt)
    assert backend.virtual_memory() is None
    mem = xgraph.GraphMemory(backend)
    assert mem.mode.value == "shared-pool"
    mem.close()
