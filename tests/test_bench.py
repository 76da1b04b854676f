"""`xgraph bench` on the CPU backend: the CLI writes complete JSON, and the anchor hooks work.

Small options keep this fast: the CPU times prove that the benchmarks run and report what
they should, not anything about speed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import xgraph
from xgraph.bench import decode
from xgraph.cli import main

HOST_TIMING = "host wall time (CPU backend)"


def bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    """Run `xgraph bench ARGS --backend cpu --json PATH` in this process; the JSON it wrote."""
    path = tmp_path / f"{args[0]}.json"
    assert main(["bench", *args, "--backend", "cpu", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def check_header(data: dict[str, Any]) -> None:
    assert data["backend"] == "cpu"
    assert data["model"] == "tiny"
    assert data["dtype"] == "torch.float32"
    assert data["device"]


def test_decode(tmp_path: Path) -> None:
    data = bench(tmp_path, "decode", "--sizes", "1,2", "--iters", "2")
    check_header(data)
    assert data["timing"] == HOST_TIMING
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        for key in ("eager_s", "xgraph_s", "xgraph_host_s", "eager/xgraph"):
            assert r[key] > 0, (key, r)
        # the CPU backend has no native graph API: no raw-graph anchor, no columns from it
        assert "raw_graph_s" not in r and "host_overhead_s" not in r
        assert "compile_s" not in r and "compile_error" not in r  # accelerators only


def test_prefill(tmp_path: Path) -> None:
    # --max-size 32: piecewise memory over 8 sizes instead of the default 22 (up to 256)
    data = bench(tmp_path, "prefill", "--sizes", "32", "--iters", "1", "--max-size", "32")
    check_header(data)
    assert data["timing"] == HOST_TIMING
    assert [r["batch"] for r in data["steps"]] == ["1x32", "4x8", "16x2", "mix+ctx"]
    for r in data["steps"]:
        assert r["num_tokens"] == 32
        assert r["eager_s"] > 0 and r["piecewise_s"] > 0 and r["eager/piecewise"] > 0
    assert data["piecewise_stats"]["captures"] >= 1
    assert data["piecewise_stats"]["replays"] >= len(data["steps"])
    assert {(m["mode"], m["order"]) for m in data["memory"]} == {
        (mode, order)
        for mode in ("shared-physical", "shared-pool")
        for order in ("ascending", "largest-first")
    }
    assert data["memory_sizes"][-1] == 32
    for m in data["memory"]:
        assert m["graphs"] == len(data["memory_sizes"])
        assert m["graph_bytes"] > 0 and m["capture_seconds"] > 0


def test_memory(tmp_path: Path) -> None:
    data = bench(tmp_path, "memory", "--sizes", "1,2,4")
    check_header(data)
    assert data["buckets"] == [1, 2, 4]
    assert data["measure"] == "pool bytes (memfd physical) and Pss"
    assert data["limit_bytes"] > 0
    runs = {(r["mode"], r["order"]): r for r in data["runs"]}
    assert len(runs) == 9
    for order in ("largest-first", "ascending", "random"):
        physical, private = runs["shared-physical", order], runs["private", order]
        assert 0 < physical["graph_bytes"] <= private["graph_bytes"], order
        assert physical["captures"] == 3 and len(physical["curve_bytes"]) == 3


class TimedCPU(type(xgraph.get_backend("cpu"))):  # type: ignore[misc]
    """The CPU backend with the two benchmark hooks an accelerator backend has: a device timer
    and a "native graph" (here: the eager call itself), so the anchor code paths run on CPU."""

    def device_name(self) -> str:
        return "test timer"

    def time_on_device(self, fn: Callable[[], Any]) -> float | None:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def native_graph(self, fn: Callable[[], Any]) -> Callable[[], None] | None:
        def replay() -> None:
            fn()

        return replay


def test_decode_with_device_hooks() -> None:
    data = decode.run(TimedCPU(), "tiny", [1, 2], iters=2)
    assert data["timing"] == "device time (test timer)"
    for r in data["rows"]:
        for key in ("raw_graph_s", "raw_replay_host_s", "xgraph/raw_graph"):
            assert r[key] > 0, (key, r)
        assert r["host_overhead_s"] == pytest.approx(r["xgraph_host_s"] - r["raw_replay_host_s"])
    text = decode.summarize(data)
    assert "raw graph ms" in text and "overhead us" in text


def test_soak_runs_random_steps_without_a_mismatch(tmp_path):
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--backend", "cpu", "--steps", "60", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["steps"] == 60 and data["mismatches"] == 0 and data["caches_equal"]
    assert data["captures"] > 0 and data["replays"] > 0 and data["samples"]
