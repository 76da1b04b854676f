"""HF Qwen3 dynamic compile under inductor realization thresholds (H200 diag)."""

import json
import os
import time

import torch
import torch._inductor.config as ic
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
compare = [8, 64]
w = reference_workload(m, b, 64, 64 * 16 + 1)
steps = decode_steps(w, compare)
res = {}
for label, cfg in [
    ("acc16", {"realize_acc_reads_threshold": 16}),
    ("op60", {"realize_opcount_threshold": 60}),
    ("both", {"realize_acc_reads_threshold": 16, "realize_opcount_threshold": 60}),
]:
    t0 = time.perf_counter()
    with ic.patch(cfg):
        ex, comp, close = hf_maker(m, b, w, "inductor", True)(compare)
        ex.capture(compare, kind="full", progress=False)
    b.synchronize()
    build = time.perf_counter() - t0
    timer = Timer(b)
    times = {s: timer(lambda st=steps[s], ex=ex: ex(**st.kwargs()), 30) * 1e3 for s in compare}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ex(**steps[8].kwargs())
        torch.cuda.synchronize()
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 5
    res[label] = {"build_s": build, "step_ms": times, "kernels_b8": n, "compile": comp.stats()}
    print(
        label,
        round(build, 1),
        {k: round(v, 4) for k, v in times.items()},
        "kernels b8",
        n,
        flush=True,
    )
    close()
    json.dump(res, open(f"{OUT}/hfdyn2.json", "w"), indent=1)
