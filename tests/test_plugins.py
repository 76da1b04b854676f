"""Backend discovery through entry points, selection rules and the errors they raise."""

from __future__ import annotations

import subprocess
import sys

import pytest

import xgraph
from xgraph.adapter import BackendSpec, IncompleteBackendError, hookimpl
from xgraph.plugins import list_backends, registry


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def test_info_lists_cpu_available_and_accelerators_with_reasons():
    infos = {b.name: b for b in list_backends()}
    assert infos["cpu"].available and infos["cpu"].priority == 0
    for name in ("cuda", "ascend"):
        assert name in infos, f"adapter {name} not discovered through its entry point"
        if not infos[name].available:
            assert infos[name].reason  # every unavailable backend says why
    prios = [b.priority for b in list_backends()]
    assert prios == sorted(prios, reverse=True)


def test_cli_info_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "xgraph.cli", "info"], capture_output=True, text=True, check=True
    ).stdout
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if line[:1].isalnum()}
    assert rows["cpu"].split()[1] == "yes"
    for name in ("cuda", "ascend"):
        assert name in rows


def test_default_is_highest_priority_available(monkeypatch):
    monkeypatch.delenv("XGRAPH_BACKEND", raising=False)
    avail = [b for b in list_backends() if b.available]
    assert xgraph.get_backend().name == avail[0].name


def test_env_var_wins_and_fails_loudly(monkeypatch):
    monkeypatch.setenv("XGRAPH_BACKEND", "cpu")
    assert xgraph.get_backend().name == "cpu"
    monkeypatch.setenv("XGRAPH_BACKEND", "npu")
    with pytest.raises(xgraph.BackendNotFoundError) as info:
        xgraph.get_backend()
    msg = str(info.value)
    assert "Unknown backend 'npu'" in msg and "XGRAPH_BACKEND" in msg and "'cpu'" in msg


def test_argument_beats_env(monkeypatch):
    monkeypatch.setenv("XGRAPH_BACKEND", "npu")
    assert xgraph.get_backend("cpu").name == "cpu"


def test_unavailable_backend_is_refused_with_its_reason():
    infos = {b.name: b for b in list_backends()}
    if infos["cuda"].available:
        pytest.skip("a CUDA device is present")
    with pytest.raises(xgraph.BackendUnavailableError) as info:
        xgraph.get_backend("cuda")
    assert infos["cuda"].reason in str(info.value) and "Available: ['cpu'" in str(info.value)


def test_dummy_adapter_is_discovered_and_selected_by_name(monkeypatch):
    monkeypatch.setenv("XGRAPH_DUMMY_BACKEND", "1")
    assert "dummy" not in {b.name for b in list_backends()}  # a test adapter: hidden
    infos = {b.name: b for b in list_backends(hidden=True)}
    assert infos["dummy"].available and infos["dummy"].plugin == "xgraph-dummy"
    backend = xgraph.get_backend("dummy")
    assert type(backend).__module__ == "xgraph_dummy.backend"
    assert backend.virtual_memory().granularity == 128 * 1024
    # hidden: listed once selected, but never chosen by priority although it outranks cpu
    assert "dummy" in {b.name for b in list_backends()}
    assert xgraph.get_backend().name == "cpu"


def test_incomplete_adapter_is_rejected_with_the_missing_methods():
    with pytest.raises(IncompleteBackendError) as info:
        xgraph.get_backend("dummy-incomplete")
    msg = str(info.value)
    assert "IncompleteBackend.as_tensor" in msg and "HalfGraph._reset" in msg
    assert "xgraph conformance" in msg
    infos = {b.name: b for b in list_backends(hidden=True)}
    assert not infos["dummy-incomplete"].available
    assert "incomplete" in infos["dummy-incomplete"].reason


def test_autoload_can_be_disabled(monkeypatch):
    monkeypatch.setenv("XGRAPH_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert [b.name for b in list_backends()] == ["cpu"]


def test_manual_registration_of_a_plugin_object():
    class Plugin:
        @hookimpl
        def xgraph_backends(self):
            return [
                BackendSpec(
                    "manual",
                    3,
                    "xgraph_dummy.backend:DummyBackend",
                    "xgraph.backends.cpu.backend:CPUBackend.availability",
                )
            ]

    registry.register(Plugin(), name="manual-plugin")
    assert "manual" in [b.name for b in list_backends()]


def test_conformance_command_runs_the_suite_against_the_dummy_adapter():
    env = {"XGRAPH_DUMMY_BACKEND": "1", "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "xgraph.cli",
            "conformance",
            "--backend",
            "dummy",
            "--",
            "-q",
            "--xgraph-capabilities",
            "linear_kernel=no",  # the dummy adapter's declaration (its conformance subclass)
            "-k",
            "not teardown",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "passed" in r.stdout and "failed" not in r.stdout


def test_conformance_command_refuses_an_unknown_backend():
    r = subprocess.run(
        [sys.executable, "-m", "xgraph.cli", "conformance", "--backend", "npu"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Unknown backend 'npu'" in r.stderr
