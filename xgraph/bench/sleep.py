"""`xgraph bench sleep`: sleep and wake with every graph kept, against closing the executors
and recapturing, side by side in one run.

The setup is an engine's: the reference model (`--model`) with its weights in the memory
region "weights" and a paged KV cache of `--kv-cache-gib` in "kv_cache"; a decode executor
with full graphs at vLLM's capture sizes (`--sizes`, default 51 up to 512 on accelerators)
and a piecewise executor at SGLang-style prefill sizes (`--piecewise-max`, default 2048),
both over one shared graph memory, every size captured.

Per cycle (`--iters` cycles, default 2: the first pays one-time costs such as pinned host
memory, the second is what a training loop sees):
- xgraph: `xgraph.sleep(decode, prefill, offload="weights")` (weights copied to host memory,
  the KV cache dropped, graph memory and persistent buffers given back, every graph kept),
  then `xgraph.wake(...)`: seconds of each, bytes given back by the driver's reading (on the
  CPU backend: the resident pages of the reservations) and by the books, the first decode
  step after wake (wall, synchronized) against a warm one, and a checked sequence of steps
  (prefill then decode over a zeroed cache, as an engine re-prefills after a dropped cache)
  compared with the same sequence before the first sleep;
- anchor: close both executors (graphs and graph memory freed) and sleep the regions the
  same way; then wake the regions and make new executors, recapturing every size.
`wake_speedup` = the anchor's wake (regions + recapture) over xgraph's wake, per cycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..buckets import sglang_piecewise_sizes, vllm_capture_sizes
from ..executor import GraphExecutor
from ..interfaces import Backend
from ..memory import GraphMemory
from ..models import Qwen3Model, Workload
from ..paging import PagedKVCache
from ..sleepmode import address_ranges, memory_reading, memory_region, sleep, wake
from .report import Checkpoint, header, note, table

GiB, MiB = 1 << 30, 1 << 20
CONTEXT = 64  # tokens per sequence in the decode layout (captures touch the dummy block)
PIECEWISE_SEQS = 16
TAGS = ("weights", "kv_cache")


def defaults(accel: bool) -> tuple[list[int], list[int], float]:
    """Decode sizes, piecewise sizes and KV-cache GiB: the Qwen3-0.6B run on accelerators,
    a small one on the CPU backend."""
    if accel:
        return vllm_capture_sizes(512), sglang_piecewise_sizes(2048), 16.0
    return vllm_capture_sizes(32), sglang_piecewise_sizes(64), 1 / 16


class Engine:
    """The model, its weights and KV cache in regions, and the two executors over them."""

    def __init__(
        self, backend: Backend, model: str, decode: list[int], pieces: list[int], kv: float
    ) -> None:
        self.backend, self.decode_sizes, self.piecewise_sizes = backend, decode, pieces
        dev = backend.device
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        with memory_region("weights", backend) as weights:
            m = Qwen3Model.build(model, num_blocks=1, block_size=16, dtype=dtype, device=dev)
        c = m.config
        per_block = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * dtype.itemsize
        blocks = max(int(kv * GiB) // per_block, max(decode) * CONTEXT // 16) - 1
        with memory_region("kv_cache", backend) as cache:
            m.kv_cache = PagedKVCache(
                c.num_layers, c.num_kv_heads, c.head_dim, blocks, 16, dtype, dev
            )
        m.mark_cache_static()
        self.regions = {"weights": weights, "kv_cache": cache}
        self.full = Workload(m, -(-CONTEXT // 16), max(decode))
        self.piecewise = Workload(m, -(-max(pieces) // 16), PIECEWISE_SEQS)
        self.executors: list[GraphExecutor] = []

    def capture(self) -> float:
        """New executors over one new graph memory, every size captured; seconds."""
        t0 = time.perf_counter()
        memory = GraphMemory(self.backend, "shared-physical")
        for w, kind, sizes in (
            (self.full, "full", self.decode_sizes),
            (self.piecewise, "piecewise", self.piecewise_sizes),
        ):
            ex = w.executor(
                w.model.forward,
                backend=self.backend,
                buckets=sizes,
                memory=memory,
                mode=kind,
                name=f"bench-sleep-{kind}",
                on_capture_error="raise",
            )
            ex.capture(sorted(sizes, reverse=True), kind=kind, progress=False)
            self.executors.append(ex)
        self.backend.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        memory = self.executors[0].memory if self.executors else None
        for ex in self.executors:
            ex.close()
        self.executors = []
        if memory is not None:
            memory.close()

    def checked(self) -> list[torch.Tensor]:
        """A prefill and decode steps over a zeroed cache: their outputs, copied."""
        import random

        for t in self.full.cache.tensors():
            t.zero_()
        rng = random.Random(21)
        full, pw = self.executors
        p = max(self.piecewise_sizes)
        prefill = self.piecewise.prefill_step(rng, [max(1, p // 4), max(1, p // 2)])
        outs = [pw(**prefill.kwargs(), clone=True)]
        m = max(self.decode_sizes)
        for batch in (1, min(8, m), min(64, m)):
            outs.append(full(**self.full.decode_step(rng, batch).kwargs(), clone=True))
        self.backend.synchronize()
        return outs

    def step_seconds(self) -> float:
        """One decode step of 8 sequences, wall time to its end on the device."""
        import random

        step = self.full.decode_step(random.Random(3), min(8, max(self.decode_sizes)))
        self.backend.synchronize()
        t0 = time.perf_counter()
        self.executors[0](**step.kwargs())
        self.backend.synchronize()
        return time.perf_counter() - t0

    def reading(self) -> int | None:
        ranges = address_ranges(*self.executors, tags=TAGS) if self.executors else []
        ranges += [rg for r in self.regions.values() for rg in r.segments.ranges()]
        return memory_reading(self.backend, list(dict.fromkeys(ranges)))


def _compare(before: list[torch.Tensor], after: list[torch.Tensor]) -> dict[str, Any]:
    """Bit for bit on the CPU backend; elsewhere within bf16's resolution (a recapture may
    choose other kernels)."""
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(before, after))
    equal = all(torch.equal(a, b) for a, b in zip(before, after))
    cpu = before[0].device.type == "cpu"
    close = all(
        torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(before, after)
    )
    return {"outputs_equal": equal, "outputs_match": equal if cpu else close, "max_abs_diff": diff}


def _xgraph_cycle(e: Engine, reference: list[torch.Tensor]) -> dict[str, Any]:
    awake = e.reading()
    s = sleep(*e.executors, tags=TAGS, offload="weights")
    asleep = e.reading()
    w = wake(*e.executors, tags=TAGS)
    first = e.step_seconds()
    warm = min(e.step_seconds() for _ in range(5))
    row = {
        "sleep_seconds": s.seconds,
        "wake_seconds": w.seconds,
        "given_back_bytes": None if awake is None or asleep is None else awake - asleep,
        "released_bytes": s.released_bytes,
        "offloaded_bytes": s.offloaded_bytes,
        "first_step_ms": first * 1e3,
        "warm_step_ms": warm * 1e3,
        "captures": sum(ex.stats()["captures"] for ex in e.executors),
    }
    return {**row, **_compare(reference, e.checked())}


def _anchor_cycle(e: Engine, reference: list[torch.Tensor]) -> dict[str, Any]:
    awake = e.reading()
    t0 = time.perf_counter()
    e.close()
    sleep(tags=TAGS, offload="weights", backend=e.backend)
    slept = time.perf_counter() - t0
    asleep = e.reading()
    t1 = time.perf_counter()
    wake(tags=TAGS, backend=e.backend)
    recapture = e.capture()
    woke = time.perf_counter() - t1
    first = e.step_seconds()
    row = {
        "sleep_seconds": slept,
        "wake_seconds": woke,
        "recapture_seconds": recapture,
        "given_back_bytes": None if awake is None or asleep is None else awake - asleep,
        "first_step_ms": first * 1e3,
    }
    return {**row, **_compare(reference, e.checked())}


def run(
    backend: Backend,
    model: str,
    decode_sizes: list[int] | None = None,
    piecewise_sizes: list[int] | None = None,
    kv_cache_gib: float | None = None,
    cycles: int = 2,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Both runs, every cycle (see the module docstring); `checkpoint` gets partial data."""
    checkpoint = checkpoint or Checkpoint(None)
    sizes, pieces, kv = defaults(backend.device.type != "cpu")
    e = Engine(backend, model, decode_sizes or sizes, piecewise_sizes or pieces, kv_cache_gib or kv)
    note(f"sleep: {len(e.decode_sizes)} decode and {len(e.piecewise_sizes)} piecewise sizes")
    data: dict[str, Any] = {**header(backend, model, e.full), "cycles": cycles}
    data["capture_seconds"] = e.capture()
    data.update(_layout(e))
    reference = e.checked()
    data["xgraph"], data["anchor"] = [], []
    for which, cycle in (("xgraph", _xgraph_cycle), ("anchor", _anchor_cycle)):
        for i in range(cycles):
            note(f"sleep: {which} cycle {i + 1} of {cycles}")
            data[which].append({"cycle": i + 1, **cycle(e, reference)})
            checkpoint(data)
    e.close()
    data["wake_speedup"] = [
        a["wake_seconds"] / x["wake_seconds"] for x, a in zip(data["xgraph"], data["anchor"])
    ]
    data["mismatches"] = sum(not r["outputs_match"] for r in data["xgraph"] + data["anchor"])
    return data


def _layout(e: Engine) -> dict[str, Any]:
    ex = e.executors[0]
    return {
        "decode_sizes": e.decode_sizes,
        "piecewise_sizes": e.piecewise_sizes,
        "graphs": sum(x.stats()["captures"] for x in e.executors),
        "graph_bytes": ex.memory.graph_bytes(),
        "persistent_bytes": sum(x.persistent_bytes() for x in e.executors),
        "weights_bytes": e.regions["weights"].nbytes,
        "kv_cache_bytes": e.regions["kv_cache"].nbytes,
        "reading": "resident pages of the reservations (smaps)"
        if e.backend.device.type == "cpu"
        else "device memory in use (driver), after empty_cache",
    }


def summarize(data: dict[str, Any]) -> str:
    cols = [
        "run",
        "cycle",
        "sleep_seconds",
        "wake_seconds",
        "given_back_MiB",
        "first_step_ms",
        "outputs_equal",
        "max_abs_diff",
    ]
    rows = []
    for which in ("xgraph", "anchor"):
        for r in data[which]:
            given = r.get("given_back_bytes")
            rows.append(
                {
                    **r,
                    "run": which if which == "xgraph" else "close + recapture",
                    "given_back_MiB": None if given is None else given / MiB,
                }
            )
    speed = ", ".join(f"{s:.1f}x" for s in data["wake_speedup"])
    head = (
        f"{data['graphs']} graphs ({len(data['decode_sizes'])} decode, "
        f"{len(data['piecewise_sizes'])} piecewise), graph memory "
        f"{data['graph_bytes'] / MiB:.0f} MiB, weights {data['weights_bytes'] / MiB:.0f} MiB "
        f"offloaded, KV cache {data['kv_cache_bytes'] / MiB:.0f} MiB dropped; first capture "
        f"{data['capture_seconds']:.1f} s. Wake vs close + recapture: {speed} faster."
    )
    return head + "\n\n" + table(rows, cols)
