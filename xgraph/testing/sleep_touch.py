"""Touching slept memory, in a process of its own: an engine's memory put to sleep, every
slept tensor read, written and run through an eager forward, then woken and checked.

    python -m xgraph.testing.sleep_touch --backend cpu

The engine is the tiny reference model with its weights in the region "weights" (offloaded)
and its KV cache in "kv_cache" (dropped), and an executor over both with full graphs and a
piecewise one. While asleep the child reads every weight and KV-cache tensor, every byte
of graph memory the graphs used and every persistent buffer (all zeros: the scratch chunk
before any write), writes into each of them, and runs eager decode and prefill forwards
over the slept weights and KV cache; the executor's own step still raises AsleepError.
After wake: the weights are bit for bit what they were, the KV cache is zeros, every graph
replays (no recapture) to its output of before (bitwise on a backend whose device is the
host, within `--atol` elsewhere), and the books are as they were awake.

A fault kills the child (SIGSEGV on the host; on a GPU an illegal address ends the CUDA
context, so every later check fails): the parent test reads the exit code and the last
line, `MARKER` followed by the readings as JSON, printed only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

import torch

MARKER = "sleep-touch: alive"
TAGS = ("weights", "kv_cache")


def build(backend: Any) -> tuple[Any, Any]:
    """The workload (weights and KV cache in regions) and an executor over it."""
    import xgraph
    from xgraph import PagedKVCache
    from xgraph.models import Qwen3Model, Workload

    with xgraph.memory_region("weights", backend):
        model = Qwen3Model.build("tiny", num_blocks=1, block_size=4, device=backend.device)
    c = model.config
    with xgraph.memory_region("kv_cache", backend):
        model.kv_cache = PagedKVCache(
            c.num_layers, c.num_kv_heads, c.head_dim, 256, 4, device=backend.device
        )
    model.mark_cache_static()
    w = Workload(model, max_blocks=8, max_seqs=16)
    w.randomize_cache(3)
    return w, w.executor(backend=backend, buckets=[1, 2, 4, 8, 16])


def slept_ranges(ex: Any) -> list[tuple[int, int]]:
    """(start, size) of what the executor's graphs used in graph memory (each capture's
    mapped extent) and of its persistent buffers: the ranges sleep covers."""
    from xgraph.sleepmode import address_ranges

    pool = ex.memory.physical
    spaces = {s.base: s.mapped * pool.chunk_size for s in pool.spaces if not s.closed}
    buffers = [(a, n) for a, n in address_ranges(ex, tags=[]) if a not in spaces]
    return [(a, n) for a, n in spaces.items() if n] + buffers


def touch(backend: Any, w: Any, ex: Any, ranges: list[tuple[int, int]]) -> dict[str, Any]:
    """Read, write and run eager forwards over everything asleep; returns what it saw."""
    from xgraph.errors import AsleepError

    tensors = [*w.model.parameters(), *w.cache.tensors()]
    raw = [backend.as_tensor(a, n) for a, n in ranges]
    nonzero = sum(int(t.count_nonzero()) for t in tensors + raw)  # the scratch, unwritten
    for t in tensors:
        t.fill_(1.5)
    for t in raw:
        t.fill_(0x3C)
    rng = random.Random(5)
    outs = [w.eager(w.decode_step(rng, 4)), w.eager(w.prefill_step(rng, [5, 3]))]
    backend.synchronize()
    try:
        ex(**w.decode_step(rng, 2).kwargs())
        refused = False
    except AsleepError:
        refused = True
    return {
        "nonzero_bytes_read": nonzero,
        "ranges": len(ranges),
        "range_bytes": sum(n for _, n in ranges),
        "eager_outputs": [list(o.shape) for o in outs],
        "step_refused": refused,
    }


def same(backend: Any, a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    if backend.device.type == "cpu":
        return torch.equal(a, b)
    return torch.allclose(a, b, atol=atol, rtol=0)


def run(name: str, atol: float) -> dict[str, Any]:
    import xgraph
    from xgraph.arena import buffer_memory

    backend = xgraph.get_backend(name)
    w, ex = build(backend)
    rng = random.Random(13)
    steps = [*(w.decode_step(rng, n) for n in (1, 5, 16)), w.prefill_step(rng, [7, 9], [0, 3])]
    kv0 = [t.clone() for t in w.cache.tensors()]
    before = [ex(**s.kwargs(), clone=True) for s in steps]
    weights = [p.clone() for p in w.model.parameters()]
    vms = [backend.virtual_memory(), buffer_memory(backend)]
    awake, captures = [vm.live() for vm in vms], ex.stats()["captures"]
    ranges = slept_ranges(ex)
    slept = xgraph.sleep(ex, offload="weights")
    seen = touch(backend, w, ex, ranges)
    woke = xgraph.wake(ex)
    checks = {
        "weights_kept": all(torch.equal(p, q) for p, q in zip(w.model.parameters(), weights)),
        "kv_zeroed": not any(bool(t.any()) for t in w.cache.tensors()),
    }
    for t, k in zip(w.cache.tensors(), kv0):
        t.copy_(k)
    outs = [ex(**s.kwargs(), clone=True) for s in steps]
    checks["replays_equal"] = all(same(backend, o, b, atol) for o, b in zip(outs, before))
    checks["no_recapture"] = ex.stats()["captures"] == captures
    checks["books_balanced"] = [vm.live() for vm in vms] == awake
    checks["scratch_freed"] = all(vm.scratch_held() == 0 for vm in vms)
    ex.close()
    seconds = {"sleep": slept.seconds, "wake": woke.seconds}
    return {"backend": name, **seen, **checks, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--atol", type=float, default=1e-5, help="replay tolerance off the host")
    args = p.parse_args(argv)
    got = run(args.backend, args.atol)
    failed = [k for k, v in got.items() if v is False]
    if got["nonzero_bytes_read"] or not got["step_refused"]:
        failed.append("reads were not zeros" if got["nonzero_bytes_read"] else "step ran")
    if failed:
        print(f"sleep-touch: failed checks {failed}: {json.dumps(got)}", file=sys.stderr)
        return 1
    print(MARKER, json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
