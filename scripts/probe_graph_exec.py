"""What full decode graphs cost the driver outside graph memory, and whether it comes back
(CUDA diagnostic). One process, the reference model's full graphs at vLLM's sizes:

1. capture every size ascending into shared-physical memory; driver growth minus the pool's
   physical bytes is what the graphs hold outside it (their executables, kernel launch
   records the driver keeps per node), divided by the graphs' kernel nodes;
2. close the executor (graphs destroyed, pool freed): what the driver still holds;
3. capture every size again, largest first, into fresh memory: growth over step 2.

Kernel nodes per graph come from torch.profiler over one replay of each graph.
JSON to argv[1]; argv[2] "eager" (default) or "compiled" (the forward's layers compiled).

    python scripts/probe_graph_exec.py out.json [eager|compiled]
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import xgraph
from xgraph.bench.anchors import compiled_twin
from xgraph.bench.readings import settle
from xgraph.bench.report import workload
from xgraph.buckets import vllm_capture_sizes
from xgraph.models import Workload

MiB = 1 << 20


def _nodes(ex: Any) -> int:
    """Kernels and copies one replay of every captured graph launches."""
    graphs = [e.graph for e in ex._graphs.values()]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _run(
    backend: Any, w: Workload, forward: Any, sizes: list[int], compiled: bool, order: list[int]
) -> dict[str, Any]:
    gm = xgraph.GraphMemory(backend, "shared-physical")
    ex = w.executor(
        forward,
        backend=backend,
        buckets=sizes,
        memory=gm,
        mode="full",
        compiled=compiled,
        on_capture_error="raise",
    )
    base = settle(backend)
    ex.capture(order, kind="full", progress=False)
    grown = settle(backend) - base
    pool = gm.graph_bytes()
    out = {
        "graphs": len(order),
        "driver_mib": grown / MiB,
        "pool_mib": pool / MiB,
        "outside_mib": (grown - pool) / MiB,
        "nodes": _nodes(ex),
    }
    out["outside_bytes_per_node"] = (grown - pool) / max(out["nodes"], 1)
    ex.close()
    gm.close()
    out["after_close_mib"] = (settle(backend) - base) / MiB
    return out


def main(path: str, variant: str) -> None:
    backend = xgraph.get_backend("cuda")
    w = workload(backend, "qwen3-0.6b", max_seqs=512, context=64)
    model = compiled_twin(w.model) if variant == "compiled" else w.model
    tw = Workload(model, w.max_blocks, w.max_seqs)
    sizes = vllm_capture_sizes(512)
    with tw.executor(
        model.forward, backend=backend, buckets=sizes, mode="eager", compiled=variant == "compiled"
    ) as first:
        first.warm_up(sizes)  # kernels loaded and compiled before anything is measured
    settle(backend)
    result: dict[str, Any] = {"variant": variant, "sizes": sizes}
    result["one"] = _run(backend, tw, model.forward, sizes, variant == "compiled", [max(sizes)])
    result["ascending"] = _run(
        backend, tw, model.forward, sizes, variant == "compiled", sorted(sizes)
    )
    result["largest_first"] = _run(
        backend, tw, model.forward, sizes, variant == "compiled", sorted(sizes, reverse=True)
    )
    for k in ("one", "ascending", "largest_first"):
        print(
            variant,
            k,
            {a: round(b, 2) if isinstance(b, float) else b for a, b in result[k].items()},
        )
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "eager")
