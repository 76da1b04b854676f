"""`xgraph bench host` on the CPU backend: every phase reported, the decode path taken."""

from __future__ import annotations

import json
from pathlib import Path

from xgraph.bench import host
from xgraph.cli import main


def test_host_bench_reports_every_phase(tmp_path: Path) -> None:
    path = tmp_path / "host.json"
    assert (
        main(
            [
                "bench",
                "host",
                "--backend",
                "cpu",
                "--sizes",
                "1,4",
                "--iters",
                "3",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    data = json.loads(path.read_text())
    assert data["backend"] == "cpu" and data["forward"] == "trivial" and data["iters"] == 3
    assert [r["batch"] for r in data["rows"]] == [1, 4]
    for r in data["rows"]:
        for phase in host.PHASES:
            assert r[f"{phase}_us"] > 0 or phase == "replay", (phase, r)
        # times only: their order is the host's to decide (three calls on a shared host
        # once read the engine's step below the raw replay it contains)
        assert r["step_us"] > 0 and r["raw_replay_us"] > 0 and r["engine_step_us"] > 0
        assert r["overhead_us"] == r["step_us"] - r["raw_replay_us"]
        assert r["beyond_engine_us"] == r["step_us"] - r["engine_step_us"]
    assert data["cpu"]
    assert "overhead_us" in host.summarize(data) and "engine_step_us" in host.summarize(data)
