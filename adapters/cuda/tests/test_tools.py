"""The adapter's measuring tools (adapters/cuda/tools/) run: they refuse clearly without a GPU,
and on a GPU they measure a small case and write it as JSON. tp_graphs.py runs on the CPU
too (gloo): its exit status follows its criterion."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from types import ModuleType

import pytest
import torch

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")


def tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def test_attention_bench_rows_cover_each_case_once():
    bench = tool("bench_attention")
    ids = [r.id for r in bench.canonical_rows()]
    assert len(ids) == len(set(ids))
    decode = {i for i in ids if i.startswith("decode/")}
    batches, tables = bench.DECODE_BATCHES, bench.DECODE_TABLES
    assert len(decode) == len(batches) * len(tables) * 2  # reference and Triton runner each
    dense = {i.split("/")[1] for i in ids if i.endswith("/sdpa-dense")}
    assert dense == {"1x2048"}  # the one single fresh sequence: dense SDPA has no context
    # torch-only rows run first, so a Triton failure cannot hide them
    runners = [r.runner for r in bench.all_rows()]
    assert runners.index("triton-decode") > max(
        i for i, r in enumerate(runners) if not r.startswith("triton")
    )


@without_cuda
def test_attention_bench_without_a_gpu_says_so(capsys):
    assert tool("bench_attention").main(["--quiet"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@needs_cuda
def test_attention_bench_measures_a_decode_row(tmp_path):
    pytest.importorskip("triton")
    path = tmp_path / "attention.json"
    args = ["--only", "decode/b1/t512/", "--iters", "3", "--warmup", "1", "--quiet"]
    assert tool("bench_attention").main([*args, "--json", str(path)]) == 0
    rows = {r["runner"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"reference", "triton-decode"}
    for row in rows.values():
        assert row["error"] is None and row["graph_us"] > 0 and row["eager_us"] > 0
    assert rows["triton-decode"]["max_abs_err"] < 0.05  # bf16 against the reference runner


@without_cuda
def test_skinny_probe_without_a_gpu_says_so(tmp_path, capsys):
    pytest.importorskip("triton")
    assert tool("probe_skinny_linear").main([str(tmp_path / "skinny.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@needs_cuda
def test_skinny_probe_times_the_chain(tmp_path):
    pytest.importorskip("triton")
    path = tmp_path / "chain.json"
    assert tool("probe_skinny_linear").main([str(path), "chain"]) == 0
    chain = json.loads(path.read_text())["chain"]
    assert set(chain) == {"1", "4"}
    for row in chain.values():
        assert row["cublas_us"] > 0 and row["skinny_us"] > 0


def tp_tool_worker(rank: int, world: int, out: str) -> list:
    """tp_graphs.py's tp stage in bf16 on the CPU, as it is, then with a criterion no row
    can hold: (exit status, its JSON) of each."""
    os.environ["OUT"] = out
    tp = tool("tp_graphs")
    args = ["--backend", "cpu", "--quick", "--dtype", "bfloat16", "--stages", "tp"]
    runs = []
    for epsilon in (None, -1.0):  # -1: every row above its bound
        from xgraph.bench import distributed_fidelity as fidelity

        saved = fidelity.EPSILON
        fidelity.EPSILON = saved if epsilon is None else epsilon
        try:
            code = tp.main(args)
        finally:
            fidelity.EPSILON = saved
        with open(os.path.join(out, "tp_graphs.json")) as f:
            runs.append([code, json.load(f)])
    return runs


def test_tp_graphs_exits_0_only_when_its_criterion_holds(tmp_path):
    from xgraph.distributed.spawn import run_ranks

    (o,) = run_ranks(tp_tool_worker, 1, args=(str(tmp_path),), timeout=240)
    (ok, good), (failed, bad) = o.value
    assert ok == 0 and failed == 1
    stage = good["ranks"][0]["tp tiny"]
    assert stage["dtype"] == "bfloat16" and "1.25 * eager_vs_fp32 + 0.001" in stage["criterion"]
    rows = [r for r in stage["decode"] + stage["prefill"] if "equal" in r]
    assert len(rows) == 3 and all(r["equal"] and r["exec_equals_single"] for r in rows)
    for r in rows:
        assert {"exec_vs_fp32", "eager_vs_fp32", "hand_vs_fp32", "bound", "exec_vs_eager"} <= set(r)
    assert stage["summary"]["failing"] == [] and stage["summary"]["rows"] == 3
    assert bad["ranks"][0]["tp tiny"]["summary"]["failing"] == [1, 4, 16]
    assert tool("tp_graphs")._failures(bad["ranks"][0]) == ["tp tiny (criterion failed)"]
