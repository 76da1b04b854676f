"""The shipped hardware check runs end to end against the simulated runtime (its expected
output on an NPU is in docs/ascend.md), and one failed check cannot fail the others."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "hardware_check.py")
ORDER = [
    "versions",
    "vmm_aliasing",
    "capture_replay",
    "vmm_inside_capture",
    "recapture_pool",
    "fused_decode",
    "stream_ceiling",
    "teardown",
]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("hardware_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(**kw: object) -> argparse.Namespace:
    base = {"dtype": torch.float32, "fused_dtype": "bfloat16", "max_graphs": 16, "settings": {}}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("era", ["owner", "context"])
def test_hardware_check_passes_on_the_simulator(tmp_path, capsys, era) -> None:  # type: ignore[no-untyped-def]
    """`hardware_check.py --backend ascend-sim --sim-era ERA`: every check passes, but for
    vmm_inside_capture in the MemPoolContext era, which has no routed pools (SKIP)."""
    module = _script()
    out = tmp_path / "hw.json"
    argv = ["--backend", "ascend-sim", "--sim-era", era, "--dtype", "float32"]
    failed = module.main([*argv, "--max-graphs", "64", "--json", str(out)])
    printed = capsys.readouterr().out
    assert failed == 0, printed
    results = {r["check"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ORDER
    assert f"pool era {era}" in results["versions"]["detail"]
    skipped = {"vmm_inside_capture"} if era == "context" else set()
    assert {c for c, r in results.items() if r["status"] == "SKIP"} == skipped, printed
    assert all(r["status"] == "PASS" for c, r in results.items() if c not in skipped), printed
    assert "64 graphs captured" in printed
    assert f"{8 - len(skipped)} passed, 0 failed, {len(skipped)} skipped" in printed
    # the fused op's configuration: bfloat16, paged blocks of 16 and of 128
    fused = results["fused_decode"]["detail"]
    assert fused.startswith("bfloat16; block 16: 10 replays") and "block 128: 10 replays" in fused


def test_sim_era_is_for_the_simulator_only(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        _script().main(["--backend", "ascend", "--sim-era", "context"])
    assert "--sim-era applies to --backend ascend-sim only" in capsys.readouterr().err


def test_vmm_inside_capture_is_skipped_in_the_mempool_context_era(make_sim, capsys) -> None:  # type: ignore[no-untyped-def]
    module = _script()
    r = module.run_check(module.check_vmm_inside_capture, make_sim(era="context"), _args())
    assert r["status"] == "SKIP" and r["ok"] and "MemPoolContext" in r["detail"]
    assert "SKIP  vmm_inside_capture" in capsys.readouterr().out


def _capture_end_fails_during(module, rt):  # type: ignore[no-untyped-def]
    """check_capture_replay with every aclmdlRICaptureEnd failing while it runs (each failure
    takes the stream out of capture, as ACL does): the check fails, nothing stays open."""
    original = module.check_capture_replay

    def check_capture_replay(backend, args):  # type: ignore[no-untyped-def]
        rt.faults.inject("aclmdlRICaptureEnd", 507899, times=1000)
        try:
            return original(backend, args)
        finally:
            rt.faults.clear()

    return check_capture_replay


@pytest.mark.parametrize("era", ["owner", "context"])
def test_a_failed_check_leaves_the_others_passing(make_sim, monkeypatch, era) -> None:  # type: ignore[no-untyped-def]
    module = _script()
    backend = make_sim(era=era)
    rt = backend.runtime
    failing = _capture_end_fails_during(module, rt)
    checks = [failing if c.__name__ == failing.__name__ else c for c in module.CHECKS]
    monkeypatch.setattr(module, "CHECKS", checks)
    results = {r["check"]: r for r in module.run(backend, _args())}
    assert list(results) == ORDER
    failed = results.pop("capture_replay")
    assert failed["status"] == "FAIL" and "ACL_ERROR_RT_DRV_INTERNAL_ERROR" in failed["detail"]
    if era == "context":  # no routed pools in that era
        assert results.pop("vmm_inside_capture")["status"] == "SKIP"
    assert {r["status"] for r in results.values()} == {"PASS"}, results
    assert rt.books() == dict.fromkeys(rt.books(), 0)


def test_without_isolation_the_device_layer_still_recovers(make_sim, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One backend (one capture stream) for every check and no cleanup by the script: the
    capture whose end failed is given up by the adapter itself (a new capture stream), so
    the next check passes all the same."""
    module = _script()
    backend = make_sim()
    rt = backend.runtime
    failing = _capture_end_fails_during(module, rt)
    monkeypatch.setattr(module, "fresh_backend", lambda b: b)
    monkeypatch.setattr(module, "end_stuck_capture", lambda b: "")
    first = module.run_check(failing, backend, _args())
    second = module.run_check(module.check_recapture_pool, backend, _args())
    assert first["status"] == "FAIL" and second["status"] == "PASS", second
    assert not rt.is_capturing(backend.capture_stream())
