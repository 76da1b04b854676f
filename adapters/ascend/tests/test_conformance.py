"""The whole conformance suite against `ascend-sim`: the adapter over the simulated runtime."""

from __future__ import annotations

import os
import subprocess
import sys

from xgraph.testing import ConformanceSuite


class TestAscendSimConformance(ConformanceSuite):
    backend_name = "ascend-sim"


def test_cli_conformance_passes_for_ascend_sim() -> None:
    """`xgraph conformance --backend ascend-sim` as a user runs it (a fresh process)."""
    env = {k: v for k, v in os.environ.items() if k != "XGRAPH_BACKEND"}
    proc = subprocess.run(
        [sys.executable, "-m", "xgraph.cli", "conformance", "--backend", "ascend-sim", "--",
         "-q", "-p", "no:randomly"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "backend 'ascend-sim' (cpu)" in proc.stdout
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
