"""The adapter contract: discovered through pluggy, every declared duty checked, CheckedGraph."""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap

import pytest
import torch

import xgraph
from xgraph.adapter import (
    Backend,
    CapturePool,
    CheckedGraph,
    CheckedVirtualMemory,
    Graph,
    IncompleteBackendError,
    check_backend_class,
)
from xgraph.plugins import list_backends, registry


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def _install_plugin(tmp_path, dist: str, module: str, backend_name: str) -> None:
    """A distribution on sys.path that declares only an xgraph.backends entry point."""
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(f"""
        from xgraph.adapter import BackendSpec, hookimpl
        from xgraph.backends.cpu.backend import CPUBackend


        class Backend(CPUBackend):
            name = {backend_name!r}


        @hookimpl
        def xgraph_backends():
            return [BackendSpec(
                name={backend_name!r}, priority=1,
                backend="{module}:Backend",
                probe="xgraph.backends.cpu.backend:CPUBackend.availability",
                distribution={dist!r}, hidden=True)]
    """)
    )
    info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[xgraph.backends]\n{module} = {module}\n")


def test_a_backend_registered_by_entry_point_alone_is_found_through_pluggy(tmp_path, monkeypatch):
    _install_plugin(tmp_path, "xgraph-epdemo", "xgraph_epdemo", "epdemo")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    pm = registry.plugin_manager()
    calls = []
    undo = pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: calls.append((name, [i.plugin_name for i in impls])),
        lambda outcome, name, impls, kwargs: None,
    )
    try:
        infos = {b.name: b for b in list_backends(hidden=True)}
    finally:
        undo()
    # pluggy loaded the entry point (it records the distribution) and called the hook on it
    plugin = pm.get_plugin("xgraph_epdemo")
    assert plugin is sys.modules["xgraph_epdemo"]
    assert "xgraph-epdemo" in [d.project_name for _, d in pm.list_plugin_distinfo()]
    assert [n for n, _ in calls] == ["xgraph_backends"]
    assert "xgraph_epdemo" in calls[0][1] and "xgraph.cpu" in calls[0][1]
    assert infos["epdemo"].available and infos["epdemo"].plugin == "xgraph-epdemo"
    assert xgraph.get_backend("epdemo").name == "epdemo"  # the class the spec names


def test_a_broken_entry_point_is_reported_and_the_others_still_load(tmp_path, monkeypatch):
    _install_plugin(tmp_path, "xgraph-good", "xgraph_goodplug", "goodplug")
    info = tmp_path / "xgraph_bad-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: xgraph-bad\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[xgraph.backends]\nbadplug = no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    infos = {b.name: b for b in list_backends(hidden=True)}
    assert infos["goodplug"].available
    assert not infos["badplug"].available and "no_such_module_xyz" in infos["badplug"].reason


# -- every declared duty, removed in turn ------------------------------------------------


def _cpu():
    """The CPU backend: a complete backend that writes every duty itself."""
    from xgraph.backends.cpu import CPUBackend, CPUGraph, HostCachingPool, HostVirtualMemory

    return CPUBackend, CPUGraph, HostCachingPool, HostVirtualMemory


def _without(cls: type, name: str) -> type:
    """`cls` as if its author had not written `name`."""
    body = {k: v for k, v in vars(cls).items() if k not in (name, "__dict__", "__weakref__")}
    return type(cls.__name__, cls.__bases__, body)


def _declared_duties() -> list[tuple[str, str]]:
    """(part, method) for every abstract method the core leaves to an adapter."""
    from xgraph.device import TorchRuntime

    parts = {
        "backend": Backend,
        "graph": CheckedGraph,
        "pool": CapturePool,
        "vm": CheckedVirtualMemory,
        "runtime": TorchRuntime,
    }
    return [(part, m) for part, base in parts.items() for m in sorted(base.__abstractmethods__)]


def test_the_cpu_backend_implements_exactly_the_declared_duties():
    backend, graph, pool, vm = _cpu()
    check_backend_class(backend)
    classes = {"backend": backend, "graph": graph, "pool": pool, "vm": vm}
    for part, method in _declared_duties():
        if part in classes:
            assert method in vars(classes[part]), f"{classes[part].__name__} lacks {method}"
    # nothing public is overridden: the core's Checked* classes own the public API
    for cls in (graph, vm):
        own = {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")}
        assert not own - {"backed_bytes"}, f"{cls.__name__} overrides {own}"


def test_the_dummy_adapter_writes_its_runtime_vmm_and_probe_only():
    """A torch-style adapter: the layer implements every backend, graph and pool duty."""
    from xgraph_dummy.backend import DummyBackend, DummyVirtualMemory

    from xgraph.device import MemPoolCapturePool, StreamGraph, TorchBackend

    check_backend_class(DummyBackend)
    assert DummyBackend.graph_class is StreamGraph and StreamGraph.pool_type is MemPoolCapturePool
    own = {n for n, v in vars(DummyBackend).items() if callable(v) or isinstance(v, classmethod)}
    assert own <= {"availability", "runtime_class", "virtual_memory_class"}, own
    assert issubclass(DummyBackend, TorchBackend)
    for method in sorted(CheckedVirtualMemory.__abstractmethods__):
        assert method in vars(DummyVirtualMemory)


@pytest.mark.parametrize("part,method", _declared_duties())
def test_removing_any_duty_is_refused_naming_it(part, method):
    from xgraph_dummy.backend import DummyBackend

    from xgraph.testing.sim import SimRuntime

    if part == "runtime":
        runtime = _without(SimRuntime, method)
        variant = type("DummyBackend", (DummyBackend,), {"runtime_class": runtime})
        owner: type = runtime
    else:
        backend, graph, pool, vm = _cpu()
        if part == "pool":
            pool = _without(pool, method)
            graph = type(graph.__name__, (graph,), {"pool_type": pool})
        elif part == "graph":
            graph = _without(graph, method)
        elif part == "vm":
            vm = _without(vm, method)
        else:
            backend = _without(backend, method)
        body = {"graph_class": graph, "virtual_memory_class": vm}
        variant = type("CPUBackend", (backend,), body)
        owner = {"backend": backend, "graph": graph, "pool": pool, "vm": vm}[part]
    with pytest.raises(IncompleteBackendError) as info:
        check_backend_class(variant)
    assert f"{owner.__name__}.{method}" in str(info.value)


def test_a_torch_style_backend_without_a_runtime_is_refused():
    from xgraph_dummy.backend import DummyBackend

    variant = type("DummyBackend", (DummyBackend,), {"runtime_class": None})
    with pytest.raises(IncompleteBackendError, match=r"DummyBackend\.runtime_class"):
        check_backend_class(variant)


def test_a_graph_that_is_not_a_checked_graph_is_refused():
    backend, *_ = _cpu()

    class Raw(Graph):
        pass

    variant = type("CPUBackend", (backend,), {"graph_class": Raw})
    with pytest.raises(IncompleteBackendError, match=r"subclass of xgraph\.adapter\.CheckedGraph"):
        check_backend_class(variant)


def test_a_class_named_unlike_its_spec_is_refused():
    from xgraph.adapter import BackendSpec, hookimpl

    class Plugin:
        @hookimpl
        def xgraph_backends(self):
            return [
                BackendSpec(
                    "renamed",
                    3,
                    "xgraph.backends.cpu.backend:CPUBackend",
                    "xgraph.backends.cpu.backend:CPUBackend.availability",
                )
            ]

    registry.register(Plugin(), name="renamed-plugin")
    with pytest.raises(IncompleteBackendError, match="is named 'cpu'"):
        xgraph.get_backend("renamed")
    info = {b.name: b for b in list_backends(hidden=True)}["renamed"]
    assert not info.available and "make them equal" in info.reason


# -- CheckedGraph's state machine, the same for every backend ------------------------------


def test_state_machine_errors_name_the_fix(cpu):
    g, pool = cpu.new_graph(), cpu.new_pool()
    with pytest.raises(xgraph.XGraphError, match="nothing captured"):
        g.replay()
    with pytest.raises(xgraph.XGraphError, match="capture_end: no capture in progress"):
        g.capture_end()
    x = torch.ones(4)
    g.capture_begin(pool)
    with pytest.raises(xgraph.XGraphError, match="call capture_end first"):
        g.capture_begin(pool)
    with pytest.raises(xgraph.XGraphError, match="still capturing"):
        g.replay()
    y = x * 2
    g.capture_end()
    with pytest.raises(xgraph.XGraphError, match="reset"):
        g.capture_begin(pool)
    g.replay()
    assert torch.equal(y, torch.full((4,), 2.0))
    pool.close()
    with pytest.raises(xgraph.PoolClosedError):
        g.replay()
    g.reset()
    with pytest.raises(xgraph.PoolClosedError):
        g.capture_begin(pool)
    with pytest.raises(xgraph.XGraphError, match="needs a pool from"):
        g.capture_begin(object())  # type: ignore[arg-type]


def test_graph_context_manager_captures_any_callable(cpu):
    x = torch.arange(6, dtype=torch.float32)
    g = cpu.new_graph()
    with torch.no_grad():
        with xgraph.graph(g):
            y = (x * 3).sum(0, keepdim=True)
    assert g.owned_pool is not None and not g.capturing
    x.fill_(1)
    g.replay()
    assert torch.equal(y, torch.tensor([18.0]))  # 6 ones, times 3
    pool = g.owned_pool
    g.reset()
    assert pool.closed  # the graph's own pool goes with it


def test_graph_context_manager_aborts_on_any_exception(cpu):
    g = cpu.new_graph()
    with pytest.raises(KeyboardInterrupt):
        with xgraph.graph(g):
            torch.ones(3) * 2
            raise KeyboardInterrupt
    assert not g.capturing and g.owned_pool is None
    assert not xgraph.safety.host_conversions_blocked()
    assert torch.ones(2).tolist() == [1.0, 1.0]


def test_update_callbacks_run_before_each_replay(cpu):
    x, seen = torch.zeros(3), []
    g = cpu.new_graph()
    with torch.no_grad(), xgraph.graph(g):
        xgraph.graphs.capturing_graph().add_update(lambda: (seen.append(1), x.add_(1)))
        y = x * 2
    assert seen == []
    g.replay()
    g.replay()
    assert seen == [1, 1] and torch.equal(y, torch.full((3,), 4.0))
    with pytest.raises(xgraph.XGraphError, match="only a graph being captured"):
        g.add_update(lambda: None)
    g.reset()
