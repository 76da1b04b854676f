"""Where does memory outside the graph pool come from? (CUDA diagnostic)

Captures graphs in ascending order into shared-physical memory and, after each capture,
reads the driver (total - free, after empty_cache), the pool's physical bytes and the
caching allocator; at the end lists every default-pool segment that empty_cache could not
return, with the Python frames that allocated its live blocks. JSON to argv[1].

    python scripts/probe_outside_pool.py out.json [reference-piecewise|hf-full|hf-piecewise]
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import torch

import xgraph
from xgraph.bench.report import workload
from xgraph.buckets import sglang_piecewise_sizes, vllm_capture_sizes

MiB = 1 << 20


def _reading(backend: Any, gm: xgraph.GraphMemory) -> dict[str, float]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    segs = torch.cuda.memory._snapshot()["segments"]
    default = [g for g in segs if tuple(g.get("segment_pool_id", (0, 0))) == (0, 0)]
    return {
        "default_segments_mib": sum(g["total_size"] for g in default) / MiB,
        "default_live_mib": sum(g["allocated_size"] for g in default) / MiB,
        "default_segments": len(default),
        "graph_segments": len(segs) - len(default),
        "driver_mib": (total - free) / MiB,
        "pool_mib": gm.graph_bytes() / MiB,
        "reserved_mib": torch.cuda.memory_reserved() / MiB,
        "allocated_mib": torch.cuda.memory_allocated() / MiB,
    }


def _stuck_segments(limit: int = 12) -> list[dict[str, Any]]:
    """Default-pool segments still held after empty_cache, largest first, with their frames."""
    snap = torch.cuda.memory._snapshot()
    out = []
    for seg in snap["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        live = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
        frames = []
        for b in live[:4]:
            fr = [
                f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
                for f in b.get("frames", [])
                if f["filename"].endswith(".py")
            ][:10]
            frames.append({"size": b["size"], "frames": fr})
        out.append(
            {
                "segment_mib": seg["total_size"] / MiB,
                "allocated_mib": seg["allocated_size"] / MiB,
                "stream": seg.get("stream"),
                "live_blocks": len(live),
                "blocks": frames,
            }
        )
    out.sort(key=lambda s: -s["segment_mib"])
    return out[:limit]


def _executor(case: str, backend: Any, gm: xgraph.GraphMemory) -> tuple[Any, list[int], Any]:
    if case == "reference-piecewise":
        w = workload(backend, "qwen3-0.6b", max_seqs=16, context=4096)
        sizes = sglang_piecewise_sizes(2048)
        ex = w.executor(
            w.model.forward, backend=backend, buckets=sizes, memory=gm, mode="piecewise"
        )
        return ex, sizes, "piecewise"
    from xgraph.integrations.transformers.bench_runs import build_named
    from xgraph.integrations.transformers.model import GraphModel

    model = build_named("qwen3-0.6b", torch.bfloat16, backend.device)
    full = case == "hf-full"
    sizes = vllm_capture_sizes(256) if full else sglang_piecewise_sizes(1024)
    gmodel = GraphModel(
        model,
        backend=backend,
        buckets=sizes,
        memory=gm,
        mode="full" if full else "piecewise",
        max_seqs=256,
        max_model_len=2048,
        num_blocks=2048,
    )
    return gmodel.executor, sizes, "full" if full else "piecewise"


def main() -> None:
    path, case = sys.argv[1], sys.argv[2]
    order = sys.argv[3] if len(sys.argv) > 3 else "ascending"
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    backend = xgraph.get_backend("cuda")
    gm = xgraph.GraphMemory(backend, "shared-physical")
    ex, sizes, kind = _executor(case, backend, gm)
    base = _reading(backend, gm)
    steps = []
    for n in sorted(sizes, reverse=order == "largest-first"):
        ex.capture([n], kind=kind, progress=False)
        r = _reading(backend, gm)
        steps.append({"size": n, **{k: v - base[k] for k, v in r.items()}})
    result = {
        "case": case,
        "order": order,
        "base": base,
        "steps": steps,
        "stuck": _stuck_segments(),
    }
    random.seed(0)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    last = steps[-1]
    print(case, {k: round(v, 1) for k, v in last.items()})
    for s in result["stuck"][:6]:
        print(json.dumps(s)[:600])


def graph_exec_cost(path: str) -> None:
    """Driver bytes per instantiated graph of k tiny kernels (no allocations inside)."""
    x = torch.zeros(16, device="cuda")
    s = torch.cuda.Stream()
    rows = []
    for k in (1, 100, 1000):
        graphs = []
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        for _ in range(20):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                for _ in range(k):
                    x.add_(1)
            graphs.append(g)
        torch.cuda.synchronize()
        after = torch.cuda.mem_get_info()[0]
        rows.append({"kernels": k, "mib_per_graph": (before - after) / MiB / 20})
    print(rows)
    with open(path, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    if sys.argv[2] == "graph-exec":
        graph_exec_cost(sys.argv[1])
    else:
        main()
