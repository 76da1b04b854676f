"""How the driver's memory for instantiated CUDA graphs scales (CUDA diagnostic): per kernel
node or per graph, whether it comes back, and what a process's first graph costs.

In one fresh process, with torch's caching allocator emptied before every reading (only the
driver's own memory moves: every graph is in-place adds on one preallocated tensor):

1. the first graph of the process (one kernel node), and the stack-size limit around it;
2. for k kernel nodes per graph (10 ... 3200): 16 graphs instantiated, growth per graph and
   per node;
3. every graph destroyed: what the driver still holds; then cuDeviceGraphMemTrim (documented
   for graph memory nodes only) and the reading again;
4. the largest graphs again: growth over step 3 (reuse of what the driver kept).

JSON to argv[1].

    python scripts/probe_graph_nodes.py out.json
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import torch
from cuda.bindings import runtime as rt

MiB = 1 << 20
NODES = (10, 100, 400, 1600, 3200)
PER_SIZE = 16


def used() -> int:
    """Device bytes in use by the driver's reading, the caching allocator's cache returned."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def graph_of(x: torch.Tensor, k: int, pool: Any) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        for _ in range(k):
            x.add_(1)
    return g


def stack_limit() -> int:
    err, v = rt.cudaDeviceGetLimit(rt.cudaLimit.cudaLimitStackSize)
    return int(v) if int(err) == 0 else -1


def main(path: str) -> None:
    x = torch.zeros(256, device="cuda")
    x.add_(1)  # the add kernel loaded before any reading
    pool = torch.cuda.graph_pool_handle()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    base, stack0 = used(), stack_limit()
    first = [graph_of(x, 1, pool)]
    out["first_graph"] = {
        "mib": (used() - base) / MiB,
        "stack_before": stack0,
        "stack_after": stack_limit(),
    }
    graphs: list[torch.cuda.CUDAGraph] = []
    rows = []
    for k in NODES:
        before = used()
        graphs += [graph_of(x, k, pool) for _ in range(PER_SIZE)]
        grown = used() - before
        rows.append(
            {
                "nodes_per_graph": k,
                "graphs": PER_SIZE,
                "mib": grown / MiB,
                "bytes_per_graph": grown / PER_SIZE,
                "bytes_per_node": grown / (PER_SIZE * k),
            }
        )
        print(rows[-1], flush=True)
    out["sweep"] = rows
    held = used()
    del graphs, first
    after_destroy = used()
    (err,) = rt.cudaDeviceGraphMemTrim(torch.cuda.current_device())
    out["after_destroy"] = {
        "mib_freed": (held - after_destroy) / MiB,
        "mib_still_over_base": (after_destroy - base) / MiB,
        "trim_error": int(err),
        "mib_over_base_after_trim": (used() - base) / MiB,
    }
    before = used()
    again = [graph_of(x, NODES[-1], pool) for _ in range(PER_SIZE)]
    out["again_largest"] = {"graphs": len(again), "mib": (used() - before) / MiB}
    del again
    print(json.dumps(out, indent=1))
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "graph-nodes.json")
