"""Host microseconds of the launches a start-up's eager forwards make, on their own and
inside a transformers Qwen3's warm-ups and captures: cuBLAS's `F.linear` (bf16, the
Qwen3-0.6B projection shapes at 40, 64 and 512 rows; its first call at each new row count
under each BLAS library), a one-line Triton kernel, the CUDA adapter's norm kernel and its
cuBLAS call with the ops around it (`kernels.around`); then `F.linear`, the norm and the
residual kernels timed per call inside `GraphModel(compile=False)`'s warm-ups of the 51
decode sizes (twice) and its capture. Each steady figure the mean of 200 calls after 10:

    OUT=out python experiments/launch_costs.py

Writes `$OUT/launch-costs.json`.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from probe_common import best_host_us, write

import xgraph

DEV = "cuda"
SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))  # (n, k): qkv, o, gate_up, down


def host_us(fn: Callable[[], Any]) -> float:
    """Host us per call: the mean of 200 calls after 10, the device drained around them."""
    return round(best_host_us(fn, 200, rounds=1, warm=10, sync=torch.cuda.synchronize), 1)


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, dtype=torch.bfloat16)


def steady() -> list[dict]:
    out = []
    for m in (40, 64, 512):
        for n, k in SHAPES:
            call = functools.partial(F.linear, bf16(m, k), bf16(n, k))
            out.append({"rows": m, "n": n, "k": k, "linear_us": host_us(call)})
    return out


def first_calls() -> dict[str, float]:
    """Median host us of F.linear's first call at each new row count, per BLAS library."""
    out, w, start = {}, bf16(4096, 1024), 33
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        firsts = []
        for m in range(start, 513, 8):  # row counts no earlier call has seen
            a = bf16(m, 1024)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            F.linear(a, w)
            firsts.append((time.perf_counter() - t0) * 1e6)
        start += 1
        out[lib] = round(statistics.median(firsts), 1)
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def kernels() -> dict[str, float]:
    import triton
    import triton.language as tl
    from xgraph_cuda.kernels import around

    from xgraph.fusion import Fusion

    @triton.jit
    def copy(X, N, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(X + o, tl.load(X + o, mask=o < N), mask=o < N)

    x, g, w = torch.zeros(1024, device=DEV), bf16(1024), bf16(4096, 1024)
    xf, r = torch.randn(64, 1024, device=DEV), torch.randn(64, 4096, device=DEV)
    return {
        "triton_launch_us": host_us(lambda: copy[(1,)](x, 1024, B=1024)),
        "around_norm_us": host_us(lambda: around.norm(xf, g, 1e-6, torch.bfloat16)),
        "around_run_norm_us": host_us(lambda: around.run(xf, w, Fusion(norm=g, eps=1e-6))),
        "around_run_residual_us": host_us(
            lambda: around.run(bf16(64, 1024), w, Fusion(residual=r))
        ),
    }


def in_graph_model() -> dict[str, Any]:
    """F.linear, the norm and the residual kernels timed per call inside the warm-ups and
    the capture of a GraphModel over a transformers Qwen3 (compile=False)."""
    from xgraph_cuda.kernels import around

    from xgraph.buckets import vllm_capture_sizes
    from xgraph.integrations.transformers.bench_runs import build_named
    from xgraph.integrations.transformers.bench_startup import _graph_model

    times: dict[str, list[float]] = {"linear": [], "norm": [], "residual": []}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            y = fn(*a, **k)
            times[name].append(time.perf_counter() - t0)
            return y

        return call

    kept = around.F, around.norm, around.residual
    around.F = types.SimpleNamespace(linear=timed("linear", F.linear))
    around.norm, around.residual = timed("norm", around.norm), timed("residual", around.residual)
    backend = xgraph.get_backend("cuda")
    decode = vllm_capture_sizes(512)
    gm = _graph_model(
        build_named("qwen3-0.6b", torch.bfloat16, backend.device), backend, decode, False
    )
    out: dict[str, Any] = {}
    try:
        ex = gm.executor
        phases = (("warmup", ex.warm_up), ("warmup_again", ex.warm_up), ("capture", None))
        for phase, warm in phases:
            for v in times.values():
                v.clear()
            t0 = time.perf_counter()
            warm(decode) if warm else gm.capture()
            torch.cuda.synchronize()
            out[phase] = {"seconds": round(time.perf_counter() - t0, 3)} | {
                k: {
                    "calls": len(v),
                    "median_us": round(statistics.median(v) * 1e6, 1),
                    "s": round(sum(v), 3),
                }
                for k, v in times.items()
                if v
            }
    finally:
        gm.close()
        around.F, around.norm, around.residual = kept
    return out


def main() -> None:
    xgraph.get_backend("cuda").activate()
    data = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steady": steady(),
        "first_call_us": first_calls(),
        "kernels": kernels(),
        "graph_model": in_graph_model(),
    }
    print(json.dumps(data, indent=1))
    write("launch-costs.json", data)


if __name__ == "__main__":
    main()
