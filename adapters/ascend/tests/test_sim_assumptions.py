"""The simulator's declared assumptions (`xgraph_ascend.sim.libacl.ASSUMPTIONS`): what it
takes for granted where no source settles the NPU driver's behaviour. Each is a switch that
holds by default; these tests run the adapter with it off, so what xgraph does on an NPU
that answers the other way is known, and the hardware check is shown to tell them apart.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os

import pytest
import torch
from xgraph_ascend import acl
from xgraph_ascend.sim import SimRuntime
from xgraph_ascend.sim.libacl import ASSUMPTIONS, GRAN, RT_PARAM_INVALID

from xgraph import GraphExecutor, Input

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "ascend.md")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "hardware_check.py")


def test_every_assumption_is_a_switch_on_by_default_and_documented() -> None:
    lib, docs = SimRuntime().lib, open(DOCS).read()
    assert ASSUMPTIONS  # the declaration is there
    for name, what in ASSUMPTIONS.items():
        assert getattr(lib, name) is True, name
        assert f"`{name}`" in docs, f"docs/ascend.md does not list the assumption {name}"
        assert "hardware check" in what, name  # each names what proves it on an NPU


def _map(rt, va: int, h: int) -> int:  # type: ignore[no-untyped-def]
    return rt.acl.aclrtMapMem(va, GRAN, 0, h, 0)


def test_without_aliasing_a_handle_maps_at_one_address_at_a_time() -> None:
    rt = SimRuntime()
    rt.lib.alias_handles = False
    a, b, h = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    for va in (a, b):
        assert rt.acl.aclrtReserveMemAddress(ctypes.byref(va), GRAN, 0, None, 0) == 0
    prop = acl.device_memory_prop(0)
    assert rt.acl.aclrtMallocPhysical(ctypes.byref(h), GRAN, ctypes.byref(prop), 0) == 0
    assert _map(rt, a.value, h.value) == 0
    assert _map(rt, b.value, h.value) == RT_PARAM_INVALID
    assert "alias_handles=False" in rt.acl.recent_error()
    assert rt.acl.aclrtUnmapMem(a.value) == 0
    assert _map(rt, b.value, h.value) == 0  # once unmapped there, it maps elsewhere
    assert rt.acl.aclrtUnmapMem(b.value) == 0 and rt.acl.aclrtFreePhysical(h.value) == 0
    for va in (a, b):
        assert rt.acl.aclrtReleaseMemAddress(va.value) == 0
    assert rt.books() == dict.fromkeys(rt.books(), 0)


def test_the_hardware_check_tells_a_driver_without_aliasing(make_sim) -> None:  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("hardware_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(dtype=torch.float32, max_graphs=4, settings={})
    backend = make_sim()
    assert module.run_check(module.check_vmm_aliasing, backend, args)["status"] == "PASS"
    backend.runtime.lib.alias_handles = False
    r = module.run_check(module.check_vmm_aliasing, backend, args)
    assert r["status"] == "FAIL" and "aclrtMapMem" in r["detail"], r
    assert backend.runtime.books() == dict.fromkeys(backend.runtime.books(), 0)


def _executor(backend, memory: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU()).eval()
    ex = GraphExecutor(
        lambda x: mlp(x),
        backend=backend,
        buckets=[16, 64],
        memory=memory,
        inputs=[Input("x", torch.float32, ("num_tokens", 64))],
    )
    return ex, mlp


@pytest.mark.filterwarnings("ignore::xgraph.XGraphWarning")
def test_without_aliasing_shared_physical_fails_clearly_and_shared_pool_serves(make_sim) -> None:  # type: ignore[no-untyped-def]
    """Shared-physical graph memory maps its chunks into every capture's range: on a driver
    that maps a handle once, the second capture fails naming aclrtMapMem and its key runs
    eagerly (nothing wrong is returned, the first key replays), while shared-pool memory,
    which maps nothing twice, captures both sizes (docs/ascend.md, what only hardware can
    prove, item 1)."""
    backend = make_sim()
    rt = backend.runtime
    rt.lib.alias_handles = False
    ex, mlp = _executor(backend, "shared-physical")
    with torch.no_grad():
        for n in (16, 64, 16, 64):  # the first capture maps each chunk once
            x = torch.randn(n, 64)
            assert torch.equal(ex(x=x), mlp(x))
    s = ex.stats()
    assert s["hits"] == {("full", 16): 1} and "aclrtMapMem" in s["failed_keys"][("full", 64)]
    ex.close()
    ex, mlp = _executor(backend, "shared-pool")
    with torch.no_grad():
        for n in (16, 64, 16):
            x = torch.randn(n, 64)
            assert torch.equal(ex(x=x), mlp(x))
    assert ex.stats()["captures"] == 2
    ex.close()
    assert rt.books() == dict.fromkeys(rt.books(), 0), rt.books()
