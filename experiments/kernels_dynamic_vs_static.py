"""HF Qwen3 decode step: dynamic vs static compile, kernels per replay (H200 diag)."""

import collections
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from xgraph.bench.timing import Timer
from xgraph.integrations.transformers.bench_compile import (
    decode_steps,
    hf_maker,
    reference_workload,
)
from xgraph.integrations.transformers.bench_runs import build_named
from xgraph.plugins import get_backend

OUT = os.environ["OUT"]
b = get_backend("cuda")
m = build_named("qwen3-0.6b", torch.bfloat16, b.device)
compare = [1, 8, 64]
w = reference_workload(m, b, 512, 64 * 16 + 1)
steps = decode_steps(w, compare)
res = {}
for label, dyn, sizes in [
    ("dynamic", True, compare),
    ("static", False, compare),
    ("dynamic512", True, [*compare, 512]),
]:
    t0 = time.perf_counter()
    ex, comp, close = hf_maker(m, b, w, "inductor", dyn)(sizes)
    for s in sizes:
        if s in steps:
            ex(**steps[s].kwargs())
    ex.capture(sizes, kind="full", progress=False)
    b.synchronize()
    build = time.perf_counter() - t0
    timer = Timer(b)
    times = {s: timer(lambda st=steps[s], ex=ex: ex(**st.kwargs()), 30) * 1e3 for s in compare}
    per = {}
    for s in (8, 64):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                ex(**steps[s].kwargs())
            torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                agg[e.name][0] += 1
                agg[e.name][1] += e.device_time_total
        per[s] = {k: [v[0] / 5, v[1] / 5] for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])}
    res[label] = {
        "build_s": build,
        "step_ms": times,
        "compile": comp.stats() if comp else None,
        "kernels": per,
    }
    print(label, round(build, 1), {k: round(v, 4) for k, v in times.items()}, flush=True)
    for s in (8, 64):
        tot = sum(v[1] for v in per[s].values())
        n = sum(v[0] for v in per[s].values())
        print(f"  b{s}: {n:.0f} kernels, {tot:.1f} us")
        for k, v in list(per[s].items())[:14]:
            print(f"    {v[0]:6.0f} {v[1]:8.1f}  {k[:110]}")
    close()
    json.dump(res, open(f"{OUT}/hfdyn.json", "w"), indent=1)
