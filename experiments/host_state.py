"""Whether a synchronized step's host time depends on what the host did before it: the
executor's decode step and the hand-captured graph's replay, taken in turn as `xgraph bench
decode` takes them (synchronize, then the call), with the host (a) straight out of the
synchronize, (b) kept busy for `--spin-us` after it, (c) asleep for a millisecond after it.

    OUT=out XGRAPH_CUDA_LINEAR=triton XGRAPH_PDL=1 python experiments/host_state.py \\
        --models qwen3-0.6b:1,8,64 qwen3-8b:1

Writes `$OUT/host-state.json`: per model, batch and case the median host us of each call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from probe_common import decode_workload, write

from xgraph.bench.anchors import native_anchor


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


CASES = {
    "after-sync": lambda a: None,
    "busy": lambda a: spin(a.spin_us),
    "asleep": lambda a: time.sleep(1e-3),
}


def timed(backend, fns: dict, before, iters: int) -> dict:
    ts: dict = {n: [] for n in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            backend.synchronize()
            before()
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    backend.synchronize()
    return {n: round(statistics.median(v) * 1e6, 2) for n, v in ts.items()}


def model_rows(model: str, batches: list[int], a) -> dict:
    backend, w, steps = decode_workload(model, batches)
    out = {}
    ex = w.executor(w.model.forward, backend=backend, buckets=batches, on_capture_error="raise")
    for b in batches:
        step = steps[b]
        replay, send = native_anchor(backend, w, step)  # send holds the graph's inputs
        call = lambda s=step: ex(**s.kwargs())  # noqa: E731
        for _ in range(5):
            call()
        fns = {"xgraph": call, "raw": replay}
        row = {c: timed(backend, fns, lambda f=f: f(a), a.iters) for c, f in CASES.items()}
        for r in row.values():
            r["overhead"] = round(r["xgraph"] - r["raw"], 2)
        out[str(b)] = row
        print(model, b, row, flush=True)
        del replay, send
    ex.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b:1,8,64"])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--spin-us", type=float, default=500.0)
    a = p.parse_args()
    out: dict = {"spin_us": a.spin_us, "iters": a.iters, "models": {}}
    with torch.no_grad():
        for spec in a.models:
            model, sizes = spec.split(":")
            batches = [int(x) for x in sizes.split(",")]
            out["models"][model] = model_rows(model, batches, a)
    write("host-state.json", out)


if __name__ == "__main__":
    main()
