"""HF Qwen3, 51 buckets captured largest first: the rotary reductions' times at 8 tokens
with the first launch at the smallest bucket (tune) or at the largest (notune). H200.

Ran at commit e5b15fd, whose executor called `launch_small_first` before a compiled
forward's first launch (xgraph/tuning.py); measured to change nothing, it was taken out."""

import collections
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import xgraph.executor as xe
from xgraph.bench.timing import Timer
from xgraph.buckets import vllm_capture_sizes
from xgraph.integrations.transformers.bench_compile import (
    decode_steps,
    hf_maker,
    reference_workload,
)
from xgraph.integrations.transformers.bench_runs import build_named
from xgraph.plugins import get_backend

label = sys.argv[1]
if label == "notune":
    xe.launch_small_first = lambda ex, step: None
OUT = os.environ["OUT"]
b = get_backend("cuda")
m = build_named("qwen3-0.6b", torch.bfloat16, b.device)
compare = [1, 8, 64]
sizes = vllm_capture_sizes(512)
w = reference_workload(m, b, 512, 64 * 16 + 1)
steps = decode_steps(w, compare)
t0 = time.perf_counter()
ex, comp, close = hf_maker(m, b, w, "inductor", True)(sizes)
ex.capture(sorted(sizes, reverse=True), kind="full", progress=False)
b.synchronize()
build = time.perf_counter() - t0
timer = Timer(b)
times = {s: timer(lambda st=steps[s]: ex(**st.kwargs()), 100) * 1e3 for s in compare}
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        ex(**steps[8].kwargs())
    torch.cuda.synchronize()
agg = collections.defaultdict(lambda: [0, 0.0])
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        agg[e.name][0] += 1
        agg[e.name][1] += e.device_time_total / 5
rope = sorted(v[1] for k, v in agg.items() if "rsqrt" in k and "sin" in k and "_per_" in k)
res = {"label": label, "build_s": build, "step_ms": times, "rope_reductions_us": rope}
res["kernels_b8"] = {k: v for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])}
print(
    label, round(build, 1), {k: round(v, 4) for k, v in times.items()}, [round(r, 1) for r in rope]
)
json.dump(res, open(f"{OUT}/tune-{label}.json", "w"), indent=1)
close()
