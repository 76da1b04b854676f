"""Availability: why `ascend` cannot run here, in words a user can act on; `ascend-sim`
listed only once selected; the DLPack capsule behind as_tensor."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from xgraph_ascend import dlpack, probe

import xgraph
from xgraph.plugins import list_backends, registry


@pytest.fixture(autouse=True)
def fresh_registry():  # type: ignore[no-untyped-def]
    registry.reset()
    yield
    registry.reset()


def _fake_torch_npu(tmp_path, monkeypatch, body: str) -> None:  # type: ignore[no-untyped-def]
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)


def test_without_torch_npu_the_reason_says_to_install_it() -> None:
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    avail = probe.availability()
    assert not avail.available
    assert "torch_npu is not installed" in avail.reason and "CANN" in avail.reason


@pytest.mark.parametrize(
    "body, words",
    [
        (
            """
            try:
                raise ImportError("libhccl.so: cannot open shared object file: No such file")
            except ImportError as e:
                raise ImportError("torch_npu/_C.so failed to load") from e
            """,
            ["CANN libraries are missing", "libhccl.so", "set_env.sh"],
        ),
        (
            """
            raise RuntimeError("Failed to load the backend extension: torch_npu. You can "
                               "disable extension auto-loading with "
                               "TORCH_DEVICE_BACKEND_AUTOLOAD=0.")
            """,
            ["autoload", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"],
        ),
        (
            'raise RuntimeError("Two accelerators cannot be used at the same time in PyTorch.")',
            ["CUDA build of torch", "CPU build"],
        ),
        ('raise OSError("disk on fire")', ["importing torch_npu", "failed", "disk on fire"]),
    ],
)
def test_any_import_failure_is_named(tmp_path, monkeypatch, body, words) -> None:  # type: ignore[no-untyped-def]
    _fake_torch_npu(tmp_path, monkeypatch, body)
    avail = probe.availability()
    assert not avail.available
    for w in words:
        assert w in avail.reason, avail.reason


def _fake_npu_stack(tmp_path, monkeypatch, c_attrs: str, top_attrs: str) -> None:  # type: ignore[no-untyped-def]
    """An importable torch_npu of the 7.0.0 graph API with the given extras, and torch.npu."""
    _fake_torch_npu(
        tmp_path,
        monkeypatch,
        f"""
        import types
        __version__ = "2.6.0.fake"
        npu = types.SimpleNamespace(memory=types.SimpleNamespace())
        _C = types.SimpleNamespace({c_attrs})
        {top_attrs}
        """,
    )
    api = dict.fromkeys(("NPUGraph", "graph_task_group_begin", "graph_task_update_begin"), None)
    npu = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        get_device_name=lambda: "Ascend910B4",
        ExternalEvent=object,
        **api,
    )
    monkeypatch.setattr(torch, "npu", npu, raising=False)


def test_a_torch_npu_without_npu_from_dlpack_is_unavailable(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """as_tensor needs torch_npu._C._npu_from_dlpack: the 7.3.0 branches on."""
    _fake_npu_stack(tmp_path, monkeypatch, "", "")
    avail = probe.availability()
    assert not avail.available
    assert "torch_npu._C._npu_from_dlpack" in avail.reason and "7.3.0" in avail.reason


@pytest.mark.parametrize(
    "top, support",
    [
        (
            "npu_fused_infer_attention_score = _npu_fused_infer_attention_score_get_max_workspace"
            " = print",
            "yes",
        ),
        (
            "npu_fused_infer_attention_score = print",
            "no: this torch_npu lacks torch_npu._npu_fused_infer_attention_score_get_max_workspace",
        ),
    ],
)
def test_the_fused_runner_is_a_capability(tmp_path, monkeypatch, top, support) -> None:  # type: ignore[no-untyped-def]
    """What only FusedDecodeRunner needs does not make the backend unavailable."""
    _fake_npu_stack(tmp_path, monkeypatch, "_npu_from_dlpack=print", top)
    avail = probe.availability()
    assert avail.available, avail.reason
    assert avail.versions["fused decode"] == support
    assert f"FusedDecodeRunner {support}" in avail.reason
    assert avail.versions["pool era"] == "owner"  # no MemPoolContext


def test_selecting_ascend_raises_with_the_reason() -> None:
    reason = {b.name: b for b in list_backends()}["ascend"].reason
    with pytest.raises(xgraph.BackendUnavailableError) as info:
        xgraph.get_backend("ascend")
    assert reason in str(info.value)


def _info(env_extra: dict[str, str], *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XGRAPH_BACKEND"}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "xgraph.cli", "info", *args],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    ).stdout


def test_xgraph_info_explains_ascend_and_hides_the_simulator() -> None:
    rows = {b["name"]: b for b in json.loads(_info({}, "--json"))}
    assert not rows["ascend"]["available"] and rows["ascend"]["reason"]
    if importlib.util.find_spec("torch_npu") is None:
        assert "torch_npu is not installed" in rows["ascend"]["reason"]
    assert "ascend-sim" not in rows
    text = " ".join(_info({"XGRAPH_BACKEND": "ascend-sim"}).split())  # selected: listed
    assert "ascend-sim yes" in text and "simulated ACL runtime" in text
    assert "selected: ascend-sim" in text


def test_simulator_is_never_chosen_by_priority(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("XGRAPH_BACKEND", raising=False)
    assert xgraph.get_backend().name != "ascend-sim"
    assert "ascend-sim" not in {b.name for b in list_backends()}
    assert xgraph.get_backend("ascend-sim").name == "ascend-sim"
    assert "ascend-sim" in {b.name for b in list_backends()}  # listed once selected


def test_dlpack_capsule_describes_the_memory() -> None:
    """The capsule as_tensor hands torch_npu, checked with torch's own DLPack reader (CPU)."""
    buf = (ctypes.c_uint8 * 4096)()
    address = ctypes.addressof(buf)
    before = dlpack.live_capsules()
    t = torch.utils.dlpack.from_dlpack(dlpack.capsule(address, 4096, dlpack.KDL_CPU, 0))
    assert t.dtype == torch.uint8 and t.shape == (4096,) and t.data_ptr() == address
    t[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert list(buf[:3]) == [1, 2, 3]
    del t
    gc.collect()
    assert dlpack.live_capsules() == before  # torch called the deleter
