"""The shipped hardware check runs end to end against the simulated runtime (its expected
output on an NPU is in docs/ascend.md)."""

from __future__ import annotations

import importlib.util
import json
import os

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "hardware_check.py")


def test_hardware_check_passes_on_the_simulator(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("hardware_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "hw.json"
    argv = [
        "--backend",
        "ascend-sim",
        "--dtype",
        "float32",
        "--max-graphs",
        "64",
        "--json",
        str(out),
    ]
    failed = module.main(argv)
    printed = capsys.readouterr().out
    assert failed == 0, printed
    results = json.loads(out.read_text())["results"]
    assert [r["check"] for r in results] == [
        "versions",
        "vmm_aliasing",
        "capture_replay",
        "vmm_inside_capture",
        "recapture_pool",
        "fused_decode",
        "stream_ceiling",
        "teardown",
    ]
    assert "64 graphs captured" in printed and "8 passed, 0 failed" in printed
