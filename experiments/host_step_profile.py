"""Where an executor step's host time goes, per batch: the reference model's decode step
through `GraphExecutor` over its eager forward (as `xgraph bench decode` runs it), each call
made with an idle device, under cProfile (Python functions) and torch.profiler's CPU
activity (the runtime calls: copies, graph launches, synchronizes).

    OUT=out XGRAPH_CUDA_LINEAR=triton XGRAPH_PDL=1 python experiments/host_step_profile.py \\
        --model qwen3-0.6b --buckets 1,8,64

Writes `$OUT/host-step-profile.json`: per batch the median host us of a step and of the raw
replay of the same graph, the top functions by own time and the top runtime calls.
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch
from probe_common import buckets_of, decode_workload, parser, write

from xgraph.bench.timing import host_time


def _host_us(backend, fn, iters: int) -> float:
    return host_time(backend, fn, iters) * 1e6


def _cprofile(backend, fn, iters: int, top: int) -> str:
    pr = cProfile.Profile()
    for _ in range(iters):
        backend.synchronize()
        pr.enable()
        fn()
        pr.disable()
    backend.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def _runtime_calls(backend, fn, iters: int, top: int) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            backend.synchronize()
            fn()
        backend.synchronize()
    rows = []
    for e in prof.key_averages():
        rows.append({"name": e.key, "count": e.count, "self_us": e.self_cpu_time_total / iters})
    rows.sort(key=lambda r: -r["self_us"])
    return rows[:top]


def main() -> None:
    p = parser()
    a = p.parse_args()
    buckets = buckets_of(a)
    backend, w, steps = decode_workload(a.model, buckets)
    ex = w.executor(w.model.forward, backend=backend, buckets=buckets, on_capture_error="raise")
    out: dict = {"model": a.model, "device": str(backend.device), "buckets": {}}
    if backend.device.type == "cuda":
        out["device"] = torch.cuda.get_device_name()
    with torch.no_grad():
        for b in buckets:
            step = steps[b]
            call = lambda s=step: ex(**s.kwargs())  # noqa: E731
            for _ in range(5):
                call()
            rec = {"host_us": _host_us(backend, call, a.iters)}
            rec["kwargs_us"] = _host_us(backend, step.kwargs, a.iters)
            rec["cprofile"] = _cprofile(backend, call, a.iters, 30)
            rec["runtime_calls"] = _runtime_calls(backend, call, 50, 25)
            out["buckets"][str(b)] = rec
            print(f"batch {b}: host {rec['host_us']:.1f} us, kwargs {rec['kwargs_us']:.1f} us")
            print(rec["cprofile"])
            for r in rec["runtime_calls"]:
                print(f"  {r['self_us']:8.1f} us  x{r['count'] / 50:.0f}  {r['name'][:90]}")
    ex.close()
    write("host-step-profile.json", out)


if __name__ == "__main__":
    main()
