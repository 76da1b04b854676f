"""`xgraph bench startup` on the CPU backend: a cold and a warm process of the reference
model (and, slow, of transformers' Qwen3 compiled), parts that add up, the graph memory
predicted before the KV cache, and the same first tokens in both processes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import xgraph
from xgraph.bench import startup
from xgraph.buckets import sglang_piecewise_sizes
from xgraph.cli import main as xgraph_main

PARTS = {"start", "weights", "profile", "plan", "kv_cache", "warmup", "capture", "first_step"}


@pytest.mark.slow
def test_bench_startup_reference_cold_and_warm(tmp_path, capsys):
    out = tmp_path / "startup.json"
    args = ["bench", "startup", "--backend", "cpu", "--targets", "reference"]
    assert xgraph_main([*args, "--sizes", "1,2,4", "--piecewise-max", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    graphs = 3 + len(sglang_piecewise_sizes(8))
    assert data["capture"]["graphs"] == graphs and data["capture"]["seconds"] > 0
    # both processes read one checkpoint the bench wrote before them (float32 on the CPU)
    weights = data["weights"]
    assert weights["checkpoint"] and weights["bytes"] > 0 and weights["dtype"] == "torch.float32"
    assert data["capture"]["per_graph_s"] == pytest.approx(data["capture"]["seconds"] / graphs)
    for phase in ("cold", "warm"):
        run = data["targets"]["reference"][phase]
        assert "error" not in run, run.get("error")
        assert set(data[phase]["parts"]) == PARTS
        assert data[phase]["seconds"] == pytest.approx(sum(data[phase]["parts"].values()))
        assert run["process_seconds"] >= data[phase]["seconds"] * 0.99
        parts = data[phase]["parts"]
        assert data[phase]["xgraph_seconds"] == pytest.approx(
            data[phase]["seconds"] - parts["start"] - parts["weights"]
        )
    mp = data["memory_prediction"]
    assert mp["predicted_bytes"] > 0 and mp["rel_err"] <= 0.05
    assert data["tokens_equal"] == {"reference": True} and data["mismatches"] == []
    assert data["commit"] and "partial" not in data
    memory = data["memory"]["reference"]  # the device's reading beside the two others
    assert memory["predicted_bytes"] == mp["predicted_bytes"]
    # the CPU has no driver's reading (its own is the whole process's resident size)
    assert memory["device_graph_bytes"] is None and memory["plan_held_bytes"] is None
    printed = capsys.readouterr().out
    assert "tokens equal cold vs warm" in printed and "graph memory (cold process)" in printed


def test_the_device_reading_spans_the_plan_and_the_captures():
    """`device_graph_bytes`: from before the plan to after the captures; `plan_held_bytes`:
    what the plan left behind; both absent where the backend gives no reading."""
    from xgraph.bench.startup_run import Clock

    clock = Clock(xgraph.get_backend("cpu"))
    clock.readings = {"before_plan": 1000, "after_plan": 1100, "after_capture": 6000}
    clock.apart_bytes = 1000  # a KV cache allocated between them: not graph memory
    run = {"predicted_bytes": 4200, "measured_bytes": 4000, "readings": clock.readings}
    run["device_graph_bytes"] = clock.device_graph_bytes()
    assert startup._memory(run) == {
        "predicted_bytes": 4200,
        "measured_bytes": 4000,
        "rel_err": 0.05,
        "device_graph_bytes": 4000,
        "rel_err_device": 0.05,
        "plan_held_bytes": 100,
    }
    clock.readings["after_capture"] = None
    assert clock.device_graph_bytes() is None
    assert startup._memory({})["plan_held_bytes"] is None


class _Device:
    """A backend's reading alone: memory in use moves as the test allocates."""

    def __init__(self) -> None:
        self.in_use = 5000
        self.device = SimpleNamespace(type="accelerator")  # a driver's reading, not the CPU's

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_in_use(self) -> int:
        return self.in_use


def test_work_kept_apart_leaves_the_device_reading():
    """`Clock.apart`: what a call allocates or frees (a cache, placeholder executors) is kept
    out of the graph reading; what happens outside it counts."""
    from xgraph.bench.startup_run import Clock

    device = _Device()
    clock = Clock(device)
    clock.read("before_plan")
    device.in_use += 700  # the plan's captures leave this much held
    clock.apart(lambda: setattr(device, "in_use", device.in_use + 3000))  # the KV cache
    clock.apart(lambda: setattr(device, "in_use", device.in_use - 200))  # placeholders closed
    device.in_use += 1300  # the captures
    clock.read("after_capture")
    assert clock.apart_bytes == 2800 and clock.device_graph_bytes() == 2000


def test_a_process_that_fails_is_reported_not_raised(monkeypatch):
    """A target whose process exits with an error: its row says why; the run goes on."""
    monkeypatch.setattr(startup, "_argv", lambda *a: ["--sizes", "0"])  # refused by the child
    data = startup.run(xgraph.get_backend("cpu"), "tiny", targets=("reference",))
    assert "exit 2" in data["targets"]["reference"]["cold"]["error"]
    assert data["tokens_equal"] == {"reference": False} and data["mismatches"] == ["reference"]


@pytest.mark.slow
def test_bench_startup_hf_warm_process_loads_the_compiled_forward():
    pytest.importorskip("transformers")
    data = startup.run(xgraph.get_backend("cpu"), "tiny", [1, 2, 4], [4, 8], targets=("hf",))
    cold, warm = data["targets"]["hf"]["cold"], data["targets"]["hf"]["warm"]
    assert "error" not in cold and "error" not in warm, (cold.get("error"), warm.get("error"))
    assert cold["compile"]["cache"]["saved"] and warm["compile"]["cache"]["loaded"]
    # the warm process loads both token classes' forwards whole: nothing compiled again
    assert sorted(warm["compile"]["ahead"]["loaded"]) == ["many", "one"]
    assert warm["compile"]["ahead"]["compiled"] == []
    assert cold["parts"]["warmup"] > 0 and cold["plan"]["total_bytes"] == cold["predicted_bytes"]
    assert data["tokens_equal"] == {"hf": True}
    assert data["cold"]["parts"]["compile"] > 0 and data["warm"]["seconds"] > 0
    for run in (cold, warm):  # the modeling module's import apart from the checkpoint's read
        parts = run["parts"]
        assert parts["import"] >= 0 and parts["weights"] > 0
        mine = run["seconds"] - parts["start"] - parts["import"] - parts["weights"]
        assert run["xgraph_seconds"] == pytest.approx(mine)


def test_bench_startup_hf_eager_is_the_same_process_without_the_compile():
    pytest.importorskip("transformers")
    data = startup.run(xgraph.get_backend("cpu"), "tiny", [1, 2, 4], [4, 8], targets=("hf-eager",))
    cold, warm = data["targets"]["hf-eager"]["cold"], data["targets"]["hf-eager"]["warm"]
    assert "error" not in cold and "error" not in warm, (cold.get("error"), warm.get("error"))
    assert cold["compile"] is None and warm["compile"] is None  # nothing compiled
    assert cold["graphs"] == warm["graphs"] == 2 * 3  # decode and piecewise at each size
    assert data["tokens_equal"] == {"hf-eager": True}
    assert {"import", "weights", "load", "compile", "capture"} <= set(cold["parts"])


def test_hf_eager_runs_only_when_named():
    pytest.importorskip("transformers")
    import xgraph.integrations.transformers  # noqa: F401  (registers its targets)
    from xgraph.bench import startup_runner, startup_targets

    assert startup_targets()[0] == "reference" and "hf" in startup_targets()
    assert "hf-eager" not in startup_targets()
    assert callable(startup_runner("hf-eager"))


def test_without_safetensors_each_process_draws_its_weights(monkeypatch, tmp_path):
    """No checkpoint written (safetensors missing): the record says why and the processes
    get no folder, so they draw the weights themselves."""
    from xgraph.bench.startup_run import WEIGHTS_ENV
    from xgraph.models import checkpoint

    def missing(*args, **kwargs):
        raise ImportError("No module named 'safetensors'")

    monkeypatch.setattr(checkpoint, "write_checkpoint", missing)
    got = startup._weights(xgraph.get_backend("cpu"), "tiny", str(tmp_path))
    assert got == {"checkpoint": False, "why": "ImportError: No module named 'safetensors'"}
    seen = {}

    def run(cmd, env, **kwargs):
        seen.update(env)
        return SimpleNamespace(returncode=1, stdout="", stderr="stopped here")

    monkeypatch.setenv(WEIGHTS_ENV, "/a/folder/from/the/caller")
    monkeypatch.setattr(startup.subprocess, "run", run)
    out = startup._process("reference", [], str(tmp_path), 10.0, None)
    assert "stopped here" in out["error"] and WEIGHTS_ENV not in seen
