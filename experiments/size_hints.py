"""HF Qwen3 decode: per-size compiles against one dynamic compile under size hints (H200)."""

import collections
import functools
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import xgraph.integrations.transformers.model as gmod
from xgraph.bench.timing import Timer
from xgraph.compiled import TokenCompiled
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
buckets = [1, 8, 64, 512]
w = reference_workload(m, b, 512, 64 * 16 + 1)
steps = decode_steps(w, compare)
res = {}
variants = [v.split(":") for v in sys.argv[1].split(",")]


def kernels(ex, s):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ex(**steps[s].kwargs())
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name][0] += 1
            agg[e.name][1] += e.device_time_total
    return {k: [v[0] / 5, v[1] / 5] for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])}


for label, hint, first in variants:
    dyn = label != "static"
    gmod.TokenCompiled = functools.partial(TokenCompiled, hint=int(hint) if hint else None)
    t0 = time.perf_counter()
    ex, comp, close = hf_maker(m, b, w, "inductor", dyn)(buckets)
    if first:
        ex(**steps[int(first)].kwargs())
    if dyn:
        ex.capture(sorted(buckets, reverse=True), kind="full", progress=False)
    else:
        for s in sorted(compare, reverse=True):
            ex(**steps[s].kwargs())
    b.synchronize()
    build = time.perf_counter() - t0
    timer = Timer(b)
    times = {s: timer(lambda st=steps[s], ex=ex: ex(**st.kwargs()), 200) * 1e3 for s in compare}
    per = {s: kernels(ex, s) for s in (8, 64)}
    name = f"{label}:{hint}:{first}"
    res[name] = {"build_s": build, "step_ms": times, "compile": comp.stats(), "kernels": per}
    print(name, round(build, 1), {k: round(v, 4) for k, v in times.items()}, flush=True)
    for s in (8, 64):
        tot = sum(v[1] for v in per[s].values())
        n = sum(v[0] for v in per[s].values())
        print(f"  b{s}: {n:.0f} kernels, {tot:.1f} us", flush=True)
    close()
    json.dump(res, open(f"{OUT}/hint.json", "w"), indent=1)
st = res.get("static::")
if st:
    for k, v in res.items():
        print(k, {s: round(v["step_ms"][s] / st["step_ms"][s], 3) for s in compare})
