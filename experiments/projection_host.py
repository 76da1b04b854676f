"""Host us of one decode projection call (`xgraph_cuda.projection.fused`) with its recipe
kept against one made anew at every call (`projection.forget()` before each: what every
call paid before recipes were kept), at the Qwen3-0.6B shapes of a layer's four
projections and rows 1, 8, 16 and 32, under `no_grad` (the executor's mode), on the GPU;
with `--stub` (or without a GPU, in Triton's interpreter) the kernel's launch is replaced by
a no-op, so only the adapter's Python is timed. Each figure the best of 5 rounds of 500
calls:

    OUT=out python experiments/projection_host.py [--stub]

Writes `$OUT/projection-host.json`.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from probe_common import best_host_us, write
from xgraph_cuda import projection
from xgraph_cuda.kernels import gemv, qkv

from xgraph.fusion import Fusion, HeadNorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072  # Qwen3-0.6B
ROWS = (1, 8, 16, 32)


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEV).to(torch.bfloat16)


def calls(m: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, Fusion]]:
    """A layer's four projections at m rows, the residual stream in float32."""
    stream = torch.randn(m, HIDDEN, device=DEV)
    norm = bf16(HIDDEN)
    heads = HeadNorm(
        q_weight=bf16(HEAD_DIM),
        k_weight=bf16(HEAD_DIM),
        eps=1e-6,
        cos_sin=torch.randn(m, 2, HEAD_DIM, device=DEV),
        heads=HEADS,
        kv_heads=KV_HEADS,
    )
    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {
        "qkv": (stream, bf16(qkv_n, HIDDEN), Fusion(norm=norm, heads=heads)),
        "o": (bf16(m, HEADS * HEAD_DIM), bf16(HIDDEN, HEADS * HEAD_DIM), Fusion(residual=stream)),
        "gate_up": (stream, bf16(2 * INTER, HIDDEN), Fusion(norm=norm)),
        "down": (bf16(m, 2 * INTER), bf16(HIDDEN, INTER), Fusion(gated=True, residual=stream)),
    }


def stub() -> None:
    """The kernels' launch replaced by a no-op: the adapter's Python alone."""
    for module in (gemv, qkv):
        module.launcher = lambda kernel, grid, compile_only=False: lambda *a, **k: None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stub", action="store_true")
    a = p.parse_args()
    if a.stub or DEV == "cpu":
        stub()
    sync = torch.cuda.synchronize if DEV == "cuda" else None
    rows = []
    with torch.no_grad():
        for m in ROWS:
            for name, (x, w, f) in calls(m).items():

                def kept(x=x, w=w, f=f) -> None:
                    projection.fused(x, w, f)

                def anew(x=x, w=w, f=f) -> None:
                    projection.forget()
                    projection.fused(x, w, f)

                row = {"rows": m, "projection": name}
                for label, fn in (("kept_us", kept), ("anew_us", anew), ("kept_again_us", kept)):
                    row[label] = round(best_host_us(fn, 500, sync=sync), 2)
                rows.append(row)
                print(row, flush=True)
    write("projection-host.json", {"device": DEV, "stub": a.stub or DEV == "cpu", "rows": rows})


if __name__ == "__main__":
    main()
