"""`xgraph bench soak`: many random mixed steps, each checked against eager; memory sampled.

One executor (full-graph decode, piecewise prefill, steps above the largest bucket eager)
runs a random sequence of decode and chunked-prefill steps over a random KV cache; a second
copy of the same model runs every step eagerly on the same padded batch, so both caches
stay equal and every output must match (bit for bit on the CPU backend, within `atol` on
accelerators). Device memory is read every `sample_every` steps: after the first captures it
must stay flat.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from ..buckets import Buckets
from ..interfaces import Backend
from ..models import Workload
from . import hooks
from .readings import MiB
from .report import table

BUCKETS = [1, 2, 4, 8, 16, 32]


def _step(w: Workload, rng: random.Random, largest: int) -> Any:
    """Decode (most often), chunked prefill, or a batch above the largest bucket."""
    r = rng.random()
    if r < 0.6:
        return w.decode_step(rng, rng.randint(1, largest))
    if r < 0.95:
        lens = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))]
        return w.prefill_step(rng, lens, [rng.randint(0, 8) for _ in lens])
    return w.decode_step(rng, rng.randint(largest + 1, w.max_seqs))


def _sample(backend: Backend, ex: Any, step: int, t0: float) -> dict[str, Any]:
    return {
        "step": step,
        "seconds": time.perf_counter() - t0,
        "memory_in_use": backend.memory_in_use(),
        "graph_bytes": ex.memory.graph_bytes(),
        "captures": ex.stats()["captures"],
    }


def run(
    backend: Backend,
    steps: int = 2000,
    seed: int = 0,
    sample_every: int = 500,
    memory: str | None = None,
) -> dict[str, Any]:
    dev = backend.device
    ex_w, ref_w = (
        Workload.tiny(device=dev, num_blocks=256, max_blocks=8, max_seqs=48, seed=seed)
        for _ in range(2)
    )
    for w in (ex_w, ref_w):
        w.randomize_cache(seed)
    buckets = Buckets(BUCKETS)
    ex = ex_w.executor(backend=backend, buckets=buckets, memory=memory)
    atol = 0.0 if dev.type == "cpu" else 1e-4
    rng, t0 = random.Random(seed), time.perf_counter()
    mismatches, worst, samples = 0, 0.0, []
    for i in range(steps):
        step = _step(ex_w, rng, buckets.max)
        out = ex(**step.kwargs())
        inside = step.num_tokens <= buckets.max
        ref_step = ref_w.padded(step, buckets, full=step.attn.is_decode) if inside else step
        ref = ref_w.eager(ref_step)[: step.num_tokens]
        err = float((out.float() - ref.float()).abs().max())
        worst = max(worst, err)
        mismatches += not err <= atol  # NaN counts as a mismatch
        if i % sample_every == 0 or i == steps - 1:
            samples.append(_sample(backend, ex, i, t0))
    cache_equal = all(torch.equal(a, b) for a, b in zip(ex_w.cache.real(), ref_w.cache.real()))
    stats = ex.stats()
    ex.close()
    return {
        "backend": backend.name,
        "device": hooks.device_name(backend),
        "steps": steps,
        "mismatches": mismatches,
        "max_abs_error": worst,
        "atol": atol,
        "caches_equal": cache_equal if dev.type == "cpu" else None,
        "captures": stats["captures"],
        "replays": stats["replays"],
        "eager": stats["eager"],
        "memory": stats["memory"]["mode"],
        "samples": samples,
    }


def summarize(data: dict[str, Any]) -> str:
    rows = [
        {
            "step": s["step"],
            "s": s["seconds"],
            "in use MiB": (s["memory_in_use"] or 0) / MiB,
            "graph MiB": s["graph_bytes"] / MiB,
            "captures": s["captures"],
        }
        for s in data["samples"]
    ]
    head = (
        f"{data['backend']} / {data['device']}: {data['steps']} steps, "
        f"{data['mismatches']} mismatches (max |error| {data['max_abs_error']:.3g}, "
        f"atol {data['atol']}), {data['captures']} captures, {data['replays']} replays, "
        f"eager {data['eager']}, memory {data['memory']}"
    )
    return head + "\n\n" + table(rows, ["step", "s", "in use MiB", "graph MiB", "captures"])
