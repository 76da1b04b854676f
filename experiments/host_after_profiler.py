"""Does a torch.profiler trace leave the host slower at issuing a step afterwards?

`bench decode` times the executor's host cost of batch 8 after batch 1's kernels were traced
(probes), and the raw replay after its own batch's trace. This script times, in one process,
the executor step and the raw replay of the same graph for batches 1, 8, 64 (interleaved,
idle device, median), then traces a few steps with torch.profiler, then times them again.

    OUT=out python experiments/host_after_profiler.py [--model qwen3-0.6b] [--iters 300]

Writes $OUT/host-after-profiler.json: per phase (before, after, again_after) and batch, the
median host microseconds of the raw replay and the step, and their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from xgraph.bench.host import _calls
from xgraph.bench.kernel_trace import profile_steps
from xgraph.bench.report import workload
from xgraph.bench.timing import host_times
from xgraph.plugins import get_backend


def _times(backend, ex, steps, iters):  # type: ignore[no-untyped-def]
    out = {}
    for b, step in steps.items():
        calls = _calls(ex, step)  # `bench host`'s: the raw replay of the step's own graph
        t = host_times(backend, {"raw": calls["raw_replay"], "step": calls["step"]}, iters)
        out[b] = {k: v * 1e6 for k, v in t.items()} | {"overhead": (t["step"] - t["raw"]) * 1e6}
        print(b, {k: round(v, 1) for k, v in out[b].items()}, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument(
        "--json", default=os.path.join(os.environ.get("OUT", "."), "host-after-profiler.json")
    )
    a = p.parse_args()
    backend = get_backend("cuda")
    batches = [1, 8, 64]
    w = workload(backend, a.model, max_seqs=64, context=512)
    ex = w.executor(w.model.forward, backend=backend, buckets=batches)
    rng = random.Random(0)
    steps = {
        b: w.decode_step(rng, b, max_context=256).with_tensor_tables(
            w.max_blocks, w.cache.dummy_block
        )
        for b in batches
    }
    for s in steps.values():
        ex(**s.kwargs())
    res = {"before": _times(backend, ex, steps, a.iters)}
    profile_steps(backend, lambda: ex(**steps[1].kwargs()))
    print("-- after one torch.profiler trace", flush=True)
    res["after"] = _times(backend, ex, steps, a.iters)
    res["again_after"] = _times(backend, ex, steps, a.iters)
    ex.close()
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
