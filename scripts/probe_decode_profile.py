"""Where a decode step's device time goes (CUDA diagnostic): kernels per step by name, for
the executor over the compiled forward and for torch.compile(mode="reduce-overhead"), from
torch.profiler over replays. JSON to argv[1]; argv[2] the batch size (default 1); argv[3]
what the executor's compiled forward compiles, "layers" (default) or "forward" (the whole
forward as one graph); static shapes either way, as `bench decode` compiles; argv[4] the
executor's memory mode (default shared-physical; "private": torch's own graph pool).

    python scripts/probe_decode_profile.py out.json [BATCH] [layers|forward] [MEMORY]
"""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import xgraph
from xgraph.attention import step_context
from xgraph.bench.anchors import ReduceOverhead, compiled_twin, static_inputs
from xgraph.bench.report import workload
from xgraph.models import Workload

STEPS = 20


def _last_step(prof: Any, n: int) -> list[list[Any]]:
    """The last step's first 40 device activities in order: [name, us, us idle before it]."""
    evs = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )[-n:]
    out, end = [], None
    for e in evs[:40]:
        gap = 0.0 if end is None else e.time_range.start - end
        out.append([e.name[:70], round(e.device_time, 2), round(gap, 2)])
        end = e.time_range.end
    return out


def kernels(fn: Callable[[], Any]) -> dict[str, Any]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = by_name[e.name[:90]]
            row[0] += 1
            row[1] += e.device_time
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for _, v in rows) / STEPS
    return {
        "last_step": _last_step(prof, round(sum(v[0] for _, v in rows) / STEPS)),
        "kernels_per_step": sum(v[0] for _, v in rows) / STEPS,
        "busy_us_per_step": total,
        "top": [
            {"name": n, "per_step": c / STEPS, "us_per_step": t / STEPS} for n, (c, t) in rows[:25]
        ],
    }


def main(path: str, batch: int, scope: str = "layers", memory: str = "shared-physical") -> None:
    backend = xgraph.get_backend("cuda")
    w = workload(backend, "qwen3-0.6b", max_seqs=max(batch, 8), context=512)
    step = w.decode_step(random.Random(0), batch, max_context=256).with_tensor_tables(
        w.max_blocks, w.cache.dummy_block
    )
    out: dict[str, Any] = {
        "batch": batch,
        "scope": scope,
        "memory": memory,
        "device": torch.cuda.get_device_name(),
    }
    twin = compiled_twin(w.model, dynamic=False, scope=scope)  # as bench decode compiles it
    tw = Workload(twin, w.max_blocks, w.max_seqs)
    ex = tw.executor(twin.forward, backend=backend, buckets=[batch], compiled=True, memory=memory)
    out["xgraph over compile"] = kernels(lambda: ex(**step.kwargs()))
    ex.close()
    eager = w.executor(w.model.forward, backend=backend, buckets=[batch])
    out["xgraph"] = kernels(lambda: eager(**step.kwargs()))
    eager.close()
    ro = ReduceOverhead(backend, w.model)
    ids, pos, ctx, _send = static_inputs(backend, w, step)

    def call() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), step_context(ctx):
            ro.fn(ids, pos)

    out["reduce-overhead"] = kernels(call)
    for name in ("xgraph over compile", "xgraph", "reduce-overhead"):
        r = out[name]
        print(f"== {name}: {r['kernels_per_step']:.0f} kernels, {r['busy_us_per_step']:.0f} us")
        for t in r["top"][:12]:
            print(f"   {t['per_step']:6.1f} x {t['us_per_step']:8.1f} us  {t['name']}")
        for name, us, gap in r["last_step"][:28]:
            print(f"      {us:7.2f} us (+{gap:5.2f} idle)  {name}")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]) if len(sys.argv) > 2 else 1,
        sys.argv[3] if len(sys.argv) > 3 else "layers",
        sys.argv[4] if len(sys.argv) > 4 else "shared-physical",
    )
