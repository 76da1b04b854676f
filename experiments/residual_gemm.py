"""The residual add of a projection past 32 rows: cuBLAS then the add as its own kernel
(`kernels.around`), against one cuBLAS call that accumulates into the float32 stream
(`torch.addmm(r, x, w.T, out_dtype=float32)`, where torch has it for 16-bit inputs), and
against torch's add. Device us per call (replayed in a CUDA graph) and the difference from
the two-kernel form, at the Qwen3-0.6B and 8B o / down shapes, 64 rows. Writes
`$OUT/residual-gemm.json`.

    OUT=out python experiments/residual_gemm.py
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "adapters", "cuda", "tools"))
from bench_kernels import graph_us
from probe_common import write
from xgraph_cuda.kernels import around

SHAPES = {  # (n, k)
    "0.6b/o": (1024, 2048),
    "0.6b/down": (1024, 3072),
    "8b/o": (4096, 4096),
    "8b/down": (4096, 12288),
}
ROWS = 64
CALLS = 20


def forms(x, w, r):  # type: ignore[no-untyped-def]
    return {
        "cublas+kernel": lambda: around.residual(F.linear(x, w), r),
        "cublas+torch_add": lambda: F.linear(x, w) + r,
        "addmm_out_float32": lambda: torch.addmm(r, x, w.t(), out_dtype=torch.float32),
    }


def case(n: int, k: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(ROWS, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    r = torch.randn(ROWS, n, device="cuda", generator=g)
    want = around.residual(F.linear(x, w), r)
    out: dict = {}
    for name, fn in forms(x, w, r).items():
        try:
            got = fn()
            err = float((got.float() - want).norm() / want.norm())
            us = graph_us(lambda fn=fn: [fn() for _ in range(CALLS)], CALLS)
            out[name] = {"us": round(us, 2), "rel_diff": err, "dtype": str(got.dtype)}
        except Exception as exc:  # a form torch lacks is the finding
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def main() -> None:
    res = {"device": torch.cuda.get_device_name(), "rows": ROWS}
    res["cases"] = {name: case(n, k) for name, (n, k) in SHAPES.items()}
    print(json.dumps(res, indent=1))
    write("residual-gemm.json", res)


if __name__ == "__main__":
    main()
