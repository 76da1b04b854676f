"""`xgraph bench` on the CPU backend: the CLI writes complete JSON, and the anchor hooks work.

Small options keep this fast: the CPU times prove that the benchmarks run and report what
they should, not anything about speed.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import xgraph
from xgraph.bench import decode, memory, prefill
from xgraph.cli import main
from xgraph.integrations.transformers import bench_runs, bench_target
from xgraph.integrations.transformers.deps import require
from xgraph.integrations.transformers.errors import MissingExtraError

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
    data = bench(tmp_path, "decode", "--sizes", "1,2", "--iters", "2", "--table-check", "2")
    check_header(data)
    assert data["timing"] == HOST_TIMING
    assert "partial" not in data  # the final write replaces the checkpoints
    assert data["bandwidth_bytes_per_s"] > 0 and data["weight_bytes"] > 0
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        for key in ("eager_s", "xgraph_s", "xgraph_host_s", "eager/xgraph", "kv_bytes"):
            assert r[key] > 0, (key, r)
        # the roofline: the weights' bandwidth-limit time, each variant's fraction of it
        assert r["roofline_s"] == pytest.approx(
            data["weight_bytes"] / data["bandwidth_bytes_per_s"]
        )
        assert r["roofline_with_kv_s"] > r["roofline_s"]
        assert r["roofline"]["xgraph"] == pytest.approx(r["roofline_s"] / r["xgraph_s"])
        assert r["best_xgraph"] == "xgraph" and r["best_xgraph_vs"] == {}
        # the CPU backend has no native graph API: no raw-graph anchor, no columns from it
        assert "raw_graph_s" not in r and "host_overhead_s" not in r
        # compiled rows run on accelerators unless asked for
        assert "reduce_overhead_s" not in r and "xgraph_compiled_s" not in r
        assert not [k for k in r if k.endswith("_error")], r
    check = data["table_check"]
    assert check["batch"] == 2 and check["context"] == 512
    assert check["width_tokens"] == {"narrow": 512, "wide": 4096}
    assert check["xgraph_narrow_s"] > 0 and check["xgraph_wide_s"] > 0
    assert check["xgraph_wide/narrow"] == pytest.approx(
        check["xgraph_wide_s"] / check["xgraph_narrow_s"]
    )


def test_prefill(tmp_path: Path) -> None:
    # --max-size 32: piecewise memory over 8 sizes instead of the default 22 (up to 256)
    data = bench(tmp_path, "prefill", "--sizes", "128", "--iters", "1", "--max-size", "32")
    check_header(data)
    assert data["timing"] == HOST_TIMING
    # 16x8 at 128 tokens: sixteen sequences of eight tokens
    assert [r["batch"] for r in data["steps"]] == ["1x128", "4x32", "16x8", "mix+ctx"]
    for r in data["steps"]:
        assert r["num_tokens"] == 128
        assert r["eager_s"] > 0 and r["piecewise_s"] > 0 and r["eager/piecewise"] > 0
        assert "piecewise_compiled_s" not in r  # only with --compile
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
        assert "outside_pool_bytes" in m


def test_prefill_compiled_column() -> None:
    """The piecewise executor over the compiled forward (a fast compiler backend here)."""
    data = prefill.run(
        xgraph.get_backend("cpu"), "tiny", [16], memory_max=8, iters=1, compiler="eager"
    )
    assert data["piecewise_stats"]["compiled"]["captures"] == 1
    assert data["steps"][0]["piecewise_compiled_first_step_s"] > 0  # compile + capture
    for r in data["steps"]:
        assert r["piecewise_compiled_s"] > 0
        assert r["piecewise/piecewise_compiled"] == pytest.approx(
            r["piecewise_s"] / r["piecewise_compiled_s"]
        )
    assert "piecewise over compile ms" in prefill.summarize(data)


def _hf_available() -> bool:
    try:
        require()
    except MissingExtraError:
        return False
    return True


@pytest.mark.slow
def test_memory(tmp_path: Path) -> None:
    data = bench(tmp_path, "memory", "--sizes", "1,2,4", "--piecewise-max", "8")
    assert data["backend"] == "cpu" and data["model"] == "tiny"
    assert data["measure"] == "pool bytes (memfd physical) and Pss"
    families = ["reference", "hf-llama"] if _hf_available() else ["reference"]
    sections = {(s["family"], s["kind"]): s for s in data["sections"]}
    assert list(sections) == [(f, k) for f in families for k in ("full", "piecewise")]
    if not _hf_available():  # skipped, saying why
        assert "transformers" in data["skipped"]["hf-llama"]
    else:
        assert sections["hf-llama", "full"]["model"] == "tiny-llama"
    for (_, kind), s in sections.items():
        assert s["sizes"] == ([1, 2, 4] if kind == "full" else [4, 8])
        assert s["limit"]["graphs"] == 1 and s["limit"]["pool_bytes"] > 0
        assert [(r["mode"], r["order"]) for r in s["runs"]] == [
            ("shared-physical", o) for o in ("ascending", "random", "largest-first")
        ]
        for r in s["runs"]:
            assert r["graphs"] == len(s["sizes"]) and len(r["curve_bytes"]) == len(s["sizes"])
            assert r["driver_bytes"] is None  # no driver reading on the CPU backend
            assert "outside_pool_bytes" in r
            # shared-physical memory: every order holds what the largest size alone holds
            assert r["pool_bytes"] == s["limit"]["pool_bytes"] and r["x_limit_pool"] == 1.0
    text = memory.summarize(data)
    assert "x limit (driver)" in text and "x limit (pool)" in text


def test_memory_without_transformers_skips_the_hf_family(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise MissingExtraError("transformers is not installed. Install the extra.")

    monkeypatch.setattr(bench_runs, "require", missing)
    data = memory.run(
        xgraph.get_backend("cpu"),
        "tiny",
        [1, 2],
        families=("hf-llama", "reference"),
        kinds=("full",),
    )
    assert data["skipped"] == {
        "hf-llama": "skipped: transformers is not installed. Install the extra."
    }
    assert [s["family"] for s in data["sections"]] == ["reference"]
    assert "hf-llama: skipped: transformers is not installed" in memory.summarize(data)


def test_memory_all_modes_and_a_family_that_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """--all-modes adds shared-pool and private; a family that cannot be built is reported
    and the others still run."""

    def broken(*args: Any) -> None:
        raise RuntimeError("no such model here")

    monkeypatch.setattr(bench_target, "HFLlama", broken)
    data = memory.run(
        xgraph.get_backend("cpu"),
        "tiny",
        [1, 2],
        families=("hf-llama", "reference"),
        kinds=("full",),
        all_modes=True,
    )
    assert "no such model here" in data["skipped"]["hf-llama"]
    (s,) = data["sections"]
    runs = {(r["mode"], r["order"]): r for r in s["runs"]}
    assert len(runs) == 9
    for order in ("largest-first", "ascending", "random"):
        physical, private = runs["shared-physical", order], runs["private", order]
        assert 0 < physical["pool_bytes"] <= private["pool_bytes"], order


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
    """The anchors, the compiled rows (a fast compiler backend) and the width check over the
    compiled twin, each compile built once and reused for both batch sizes."""
    data = decode.run(
        TimedCPU(),
        "tiny",
        [1, 2],
        iters=2,
        compile_batches=[1, 2],
        table_check_batch=2,
        compiler="eager",
    )
    assert data["timing"] == "device time (test timer)"
    for r in data["rows"]:
        for key in (
            "raw_graph_s",
            "raw_replay_host_s",
            "xgraph/raw_graph",
            "reduce_overhead_s",
            "raw_graph_inputs_s",
            "reduce_overhead_inputs_s",
            "xgraph_compiled_s",
            "xgraph_compiled_first_step_s",
        ):
            assert r[key] > 0, (key, r)
        assert r["host_overhead_s"] == pytest.approx(r["xgraph_host_s"] - r["raw_replay_host_s"])
        # the per-size row runs only with compile_buckets="per-size" or "both"
        assert set(r["roofline"]) == set(decode.VARIANTS) - {"xgraph over per-size compile"}
        assert r["best_xgraph"] in ("xgraph", "xgraph over compile")
        assert set(r["best_xgraph_vs"]) == set(decode.ANCHORS)
    check = data["table_check"]
    assert check["xgraph_compiled_narrow_s"] > 0 and check["xgraph_compiled_wide_s"] > 0
    text = decode.summarize(data)
    for column in ("| raw graph |", "overhead us", "best / reduce-overhead", "% of bandwidth"):
        assert column in text, column
    assert "xgraph over compile" in text and "wide/narrow" in text


def test_decode_takes_the_step_and_the_raw_replay_host_times_in_turn(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The overhead's two host times come from one loop that calls both in turn (a host
    whose speed drifts then weighs on both alike), not from two phases apart."""
    loops: list[set[str]] = []
    real = decode.host_times

    def recorded(backend, fns, iters, until_done=False):  # type: ignore[no-untyped-def]
        loops.append(set(fns))
        return real(backend, fns, iters, until_done)

    monkeypatch.setattr(decode, "host_times", recorded)
    data = decode.run(TimedCPU(), "tiny", [1, 2], iters=2, compile_batches=[])
    assert loops == [{"xgraph", "raw"}, {"xgraph", "raw"}]
    for r in data["rows"]:
        assert r["host_overhead_s"] == pytest.approx(r["xgraph_host_s"] - r["raw_replay_host_s"])


def test_decode_compiles_once_for_every_batch_and_per_batch_side_by_side() -> None:
    """compile_buckets="both": the one-compile row compiles two graphs for batches 1, 2
    and 4 (one for a single token), the per-size row one graph per batch."""
    data = decode.run(
        TimedCPU(),
        "tiny",
        [1, 2, 4],
        iters=2,
        compile_batches=[1, 2, 4],
        compiler="eager",
        compile_scope="forward",
        compile_buckets="both",
    )
    rows = {r["batch"]: r for r in data["rows"]}
    assert [rows[b]["xgraph_compiled_compiles"] for b in (1, 2, 4)] == [1, 2, 2]
    assert [rows[b]["xgraph_per_size_compiles"] for b in (1, 2, 4)] == [1, 2, 3]
    for r in rows.values():
        assert r["xgraph_compiled_s"] > 0 and r["xgraph_per_size_s"] > 0
    text = decode.summarize(data)
    assert "xgraph over per-size compile" in text and "one / per-size compile" in text


def test_the_anchors_step_sends_every_input_into_the_static_buffers() -> None:
    """`+ inputs` anchors: the send rewrites the token inputs and all four metadata tensors."""
    import random

    from xgraph.bench.anchors import static_inputs
    from xgraph.bench.report import workload

    backend = TimedCPU()
    w = workload(backend, "tiny", max_seqs=4, context=64)
    step = w.decode_step(random.Random(0), 3, max_context=40)
    ids, pos, ctx, send = static_inputs(backend, w, step)
    md = ctx.runner.md
    targets = [ids, pos, md.slot_mapping, md.seq_lens, md.query_start_loc, md.block_tables]
    expected = [t.clone() for t in targets]
    for t in targets:
        t.fill_(-7)
    send()
    for got, want in zip(targets, expected):
        assert torch.equal(got, want)
    assert torch.equal(ids, step.input_ids) and torch.equal(pos, step.positions)


def test_decode_compiles_the_whole_forward_when_asked() -> None:
    """--compile-scope forward: xgraph's compiled row is the whole forward as one graph."""
    data = decode.run(
        TimedCPU(),
        "tiny",
        [1, 2],
        iters=2,
        compile_batches=[1, 2],
        compiler="eager",
        compile_scope="forward",
    )
    assert data["compile_scope"] == "forward"
    for r in data["rows"]:
        assert r["xgraph_compiled_s"] > 0 and "xgraph_compiled_error" not in r, r
    assert "xgraph over compile compiles: forward" in decode.summarize(data)


def test_a_failing_row_hides_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("the anchor broke")

    monkeypatch.setattr(decode, "native_anchor", broken)
    saved: list[dict[str, Any]] = []
    data = decode.run(
        TimedCPU(),
        "tiny",
        [1, 2],
        iters=1,
        compile_batches=[],
        checkpoint=lambda d: saved.append(copy.deepcopy(d)),
    )
    # a checkpoint after each batch, the first holding the first batch's numbers
    assert len(saved) == 2 and saved[0]["rows"][0]["xgraph_s"] > 0
    assert "xgraph_s" not in saved[0]["rows"][1]
    for r in data["rows"]:
        assert r["raw_graph_error"] == "RuntimeError: the anchor broke"
        assert r["eager_s"] > 0 and r["xgraph_s"] > 0 and "roofline_s" in r
    assert "failures:" in decode.summarize(data)


def test_soak_runs_random_steps_without_a_mismatch(tmp_path):
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--backend", "cpu", "--steps", "60", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["steps"] == 60 and data["mismatches"] == 0 and data["caches_equal"]
    assert data["captures"] > 0 and data["replays"] > 0 and data["samples"]


@pytest.mark.slow
def test_sleep_wakes_every_graph_and_matches_close_and_recapture(tmp_path):
    """In a process of its own: the benchmark's memory regions live as long as the process."""
    import subprocess
    import sys

    out = tmp_path / "sleep.json"
    args = ["bench", "sleep", "--backend", "cpu", "--sizes", "1,2,4", "--piecewise-max", "8"]
    args += ["--kv-cache-gib", "0.01", "--iters", "1", "--json", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "xgraph.cli", *args], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["graphs"] == 5 and data["mismatches"] == 0 and "partial" not in data
    (x,), (anchor,) = data["xgraph"], data["anchor"]
    assert x["captures"] == 5 and x["outputs_equal"] and anchor["outputs_equal"]
    held = data["graph_bytes"] + data["kv_cache_bytes"]
    assert x["given_back_bytes"] >= 0.5 * held and x["offloaded_bytes"] > 0
    assert "close + recapture" in r.stdout


def test_decode_host_times_take_at_least_200_calls_on_an_accelerator() -> None:
    class _Accel:
        device = torch.device("cuda", 0)

    class _Cpu:
        device = torch.device("cpu")

    assert decode.host_iters(_Accel(), 30) == decode.HOST_ITERS == 200  # type: ignore[arg-type]
    assert decode.host_iters(_Accel(), 500) == 500  # type: ignore[arg-type]
    assert decode.host_iters(_Cpu(), 3) == 3  # type: ignore[arg-type]
