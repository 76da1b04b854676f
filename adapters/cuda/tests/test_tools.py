"""The adapter's measuring tools (adapters/cuda/tools/) run: they refuse clearly without a GPU,
and on a GPU they measure a small case and write it as JSON."""

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
