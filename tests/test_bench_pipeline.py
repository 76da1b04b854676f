"""`xgraph bench pipeline` on the CPU backend: every metadata placement, every column."""

from __future__ import annotations

import json

from xgraph.bench import pipeline
from xgraph.cli import main as cli_main


def test_bench_pipeline_writes_a_row_per_batch_and_placement(tmp_path):
    path = tmp_path / "pipeline.json"
    argv = ["bench", "pipeline", "--backend", "cpu", "--sizes", "1,2", "--iters", "4"]
    assert cli_main([*argv, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [(r["batch"], r["metadata"]) for r in data["rows"]] == [
        (1, "host"),
        (2, "host"),
        (1, "device"),
        (2, "device"),
        (1, "device, trusted"),
        (2, "device, trusted"),
    ]
    for r in data["rows"]:
        assert r["device_us"] > 0 and r["wall_us"] > 0 and r["call_us"] > 0
        assert 0 <= r["wait_us"] <= r["call_us"]
        assert r["issue_us"] == r["call_us"] - r["wait_us"]
    assert "issue_per_device" in pipeline.summarize(data)
