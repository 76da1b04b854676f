"""The kernel sweep tool (adapters/cuda/tools/bench_kernels.py): its cases cover every
projection once, its summary picks the fastest correct configuration and names failures,
it refuses clearly without a GPU, and on a GPU it measures a small case."""

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


def test_cases_cover_each_projection_and_row_count_once() -> None:
    bench = tool("bench_kernels")
    found = bench.cases(["qwen3-0.6b", "qwen3-8b"], [1, 8])
    ids = [c.id for c in found]
    assert len(ids) == len(set(ids)) == 2 * 4 * 2
    qkv = next(c for c in found if c.id == "qwen3-8b/qkv/m1")
    assert (qkv.n, qkv.k, qkv.heads) == ((32 + 16) * 128, 4096, (32, 8, 128))
    down = next(c for c in found if c.id == "qwen3-0.6b/down/m8")
    assert (down.n, down.k) == (1024, 3072)
    # weights, input rows (gate and up for down_proj), output and residual, bf16
    assert bench.moved_bytes(down) == 1024 * 3072 * 2 + 8 * 3072 * 4 + 8 * 1024 * 4


def test_summary_picks_the_fastest_correct_configuration() -> None:
    bench = tool("bench_kernels")
    Row = bench.Row
    rows = [
        Row("c", "default mma a", us=5.0, err=3e-3, repeat=True),
        Row("c", "mma fast-but-wrong", us=2.0, err=0.5, repeat=True),
        Row("c", "mma b", us=4.0, err=3e-3, repeat=True, tb_s=3.0),
        Row("c", "mma racy", us=3.0, err=3e-3, repeat=False),
        Row("c", "torch", us=9.0, err=1e-3),
        Row("c", "cublas", us=7.0),
        Row("c", "fma broken", error="OutOfResources: shared memory"),
    ]
    (line,) = bench.summary(rows)
    # a result that is not bitwise repeatable is never the best
    assert line["best"] == "mma b" and line["best_us"] == 4.0
    assert line["default_us"] == 5.0 and line["torch_us"] == 9.0 and line["cublas_us"] == 7.0
    assert line["failing"] == "mma fast-but-wrong, mma racy, fma broken"


@without_cuda
def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert tool("bench_kernels").main(["--quiet"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@needs_cuda
def test_it_measures_a_small_case(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    path = tmp_path / "kernels.json"
    args = ["--models", "qwen3-0.6b", "--rows", "2", "--no-attention", "--quiet"]
    assert tool("bench_kernels").main([*args, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert {s["case"] for s in data["summary"]} == {
        f"qwen3-0.6b/{p}/m2" for p in ("qkv", "o", "gate_up", "down")
    }
    for s in data["summary"]:
        assert s["best_us"] > 0 and s["default_err"] < 2e-2 and s["default_repeat"]
    assert torch.cuda.is_available()


def test_each_kernel_variant_checks_out_against_float32_math() -> None:
    """Every variant the sweep would time on a small o_proj and qkv, checked as the sweep
    checks them (in the interpreter without a GPU)."""
    pytest.importorskip("triton")
    bench = tool("bench_kernels")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for case in (bench.Case("x", "o", 2, 64, 128), bench.Case("x", "qkv", 1, 256, 64, (4, 2, 32))):
        inp = bench.make_inputs(case, copies=1, device=dev)
        for name, fn in bench.variants(case, 4).items():
            row = bench.Row(case.id, name)
            bench.check(row, fn, inp)
            assert row.repeat, name
            assert name == "cublas" or row.err < bench.TOL, (name, row.err)


@without_cuda
def test_the_pdl_race_tool_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert tool("pdl_race").main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@needs_cuda
def test_the_pdl_race_tool_checks_a_tiny_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    path = tmp_path / "race.json"
    args = ["--model", "tiny", "--buckets", "1,2", "--replays", "5", "--json", str(path)]
    assert tool("pdl_race").main(args) == 0
    data = json.loads(path.read_text())
    assert data["mismatches"] == 0 and data["buckets"] == [1, 2]
    assert all(r["clean"] and r["pdl_us"] > 0 for r in data["rows"])
