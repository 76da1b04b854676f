"""Where a decode projection launch's host time goes, on the GPU: the adapter's whole call
with its recipe kept (`projection.fused`), the launch through Triton's JIT function
(`kernel[grid](*args, **meta)`, the arguments made once), the same compiled kernel launched
through its own runner (`compiled[grid](*args)`: no binding, specialization or cache key),
its launcher called directly with everything but the stream made once, the stream's
lookup alone, and `torch.empty` of the output; for the Qwen3-0.6B gate/up projection (norm
prologue) at 1 and 16 rows, under `no_grad`. Each figure the best of 5 rounds of 500 calls,
the device drained around each round:

    OUT=out python experiments/triton_launch.py

Writes `$OUT/triton-launch.json`.
"""

from __future__ import annotations

import torch
import triton
from probe_common import best_host_us, write
from triton.runtime.driver import driver
from xgraph_cuda import family, projection
from xgraph_cuda.kernels import arena, gemv

from xgraph.fusion import Fusion

HIDDEN, INTER = 1024, 3072


def anatomy(m: int) -> dict[str, float]:
    x = torch.randn(m, HIDDEN, device="cuda")
    w = torch.randn(2 * INTER, HIDDEN, device="cuda").to(torch.bfloat16)
    norm = torch.randn(HIDDEN, device="cuda").to(torch.bfloat16)
    f = Fusion(norm=norm)
    projection.fused(x, w, f)  # compiled, recipe kept
    counts = arena.counts(x.device)
    r = projection._kept_recipe(x, w, f, family.kind(x, w, f), counts)
    y = torch.empty((m, w.shape[0]), dtype=r.out, device=x.device)
    ws = gemv.workspace(r.workspace, y)
    args = (x, w, y, y, norm, ws, counts if r.grid[1] > 1 else y, m, w.shape[0], HIDDEN)
    args += (r.per, r.pre, x.stride(0), w.stride(0), y.stride(0), y.stride(0), f.eps)
    compiled = gemv._gemv_kernel[r.grid](*args, **r.meta)
    params = [p.name for p in gemv._gemv_kernel.params]
    every = [*args, *(r.meta[p] for p in params[len(args) :])]
    runner = compiled[(*r.grid, 1)]
    device = driver.active.get_current_device()
    run, fn, packed = compiled.run, compiled.function, compiled.packed_metadata
    g0, g1, g2 = r.grid[0], r.grid[1], 1

    def direct() -> None:
        stream = driver.active.get_current_stream(device)
        run(g0, g1, g2, stream, fn, packed, None, None, None, *every)

    calls = {
        "projection.fused (recipe kept)": lambda: projection.fused(x, w, f),
        "kernel[grid](*args, **meta)": lambda: gemv._gemv_kernel[r.grid](*args, **r.meta),
        "compiled[grid](*args)": lambda: runner(*every),
        "compiled.run (launcher)": direct,
        "current stream": lambda: driver.active.get_current_stream(device),
        "torch.empty (output)": lambda: torch.empty((m, w.shape[0]), dtype=r.out, device="cuda"),
    }
    gemv._gemv_kernel[r.grid](*args, **r.meta)
    by_jit = y.clone()
    y.zero_()
    direct()
    torch.cuda.synchronize()
    same = torch.equal(by_jit, y)
    sync = torch.cuda.synchronize
    out = {name: round(best_host_us(fn, 500, sync=sync), 2) for name, fn in calls.items()}
    return out | {"direct_equals_jit": same, "triton": triton.__version__}


def main() -> None:
    rows = {}
    with torch.no_grad():
        for m in (1, 16):
            rows[m] = anatomy(m)
            print(m, rows[m], flush=True)
    write("triton-launch.json", {"rows": rows})


if __name__ == "__main__":
    main()
