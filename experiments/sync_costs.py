"""Host us of a synchronized decode step's calls, each made right after a device synchronize
(as `bench decode`'s host overhead takes them) and back to back: a one-kernel graph's
replay, the staging copy alone (cuMemcpyHtoDAsync from pinned memory, the CUDA adapter's
call), the copy then the replay, a graph that holds the copy as its first node, an event
record (and its synchronize), and the executor's check, stage and whole step over a trivial
forward at batch 1 and 64. Three ways to wait before each call: `torch.cuda.synchronize`,
the stream's synchronize, and spinning on an event's query. Answers whether a copy node
inside the graph or another way to wait would shorten the synchronized step:

    OUT=out python experiments/sync_costs.py

Writes `$OUT/sync-costs.json`.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from probe_common import best_host_us, write

import xgraph
from xgraph.bench.host import _calls, _trivial
from xgraph.bench.report import workload
from xgraph.bench.timing import host_times

Calls = dict[str, Callable[[], Any]]


def device_calls(stream: torch.cuda.Stream) -> tuple[Calls, torch.Event, tuple]:
    """The driver-level calls (replays, the copy, the event), and what they read: the
    caller keeps it alive while it calls them."""
    x = torch.zeros(1024, device="cuda")
    host = torch.zeros(1024, dtype=torch.int64).pin_memory()
    dev = torch.zeros(1024, dtype=torch.int64, device="cuda")
    memcpy = ctypes.CDLL("libcuda.so.1").cuMemcpyHtoDAsync_v2
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    memcpy.restype = ctypes.c_int
    raw = torch._C._cuda_getCurrentRawStream
    dst, src = dev.data_ptr(), host.data_ptr()

    def copy() -> None:
        memcpy(dst, src, 512, raw(0))

    for _ in range(3):  # warm-up outside the captures
        x.add_(1)
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    plain, with_copy = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain, stream=stream):
        x.add_(1)
    with torch.cuda.graph(with_copy, stream=stream):
        dev[:64].copy_(host[:64], non_blocking=True)
        x.add_(dev[0].float())
    event = torch.Event(device=torch.device("cuda"))

    def record_and_wait() -> None:
        event.record()
        event.synchronize()

    calls: Calls = {
        "replay": plain.replay,
        "copy": copy,
        "copy_then_replay": lambda: (copy(), plain.replay()),
        "replay_with_copy_node": with_copy.replay,
        "event_record": event.record,
        "event_record_and_synchronize": record_and_wait,
    }
    return calls, event, (x, host, dev, plain, with_copy)


def executor_calls() -> Calls:
    """The executor's check, stage and step over a trivial forward, at batch 1 and 64 (the
    host bench's own calls for those phases)."""
    backend = xgraph.get_backend("cuda")
    w = workload(backend, "qwen3-0.6b", max_seqs=64, context=512)
    ex = w.executor(_trivial, backend=backend, buckets=[1, 64])
    rng, calls = random.Random(0), {}
    for b in (1, 64):
        step = w.decode_step(rng, b, max_context=256).with_tensor_tables(
            w.max_blocks, w.cache.dummy_block
        )
        ex(**step.kwargs())
        phases = _calls(ex, step)
        for name, phase in (("check", "validate"), ("stage", "stage"), ("step", "step")):
            calls[f"{name}_b{b}"] = phases[phase]
    return calls


def synced(calls: Calls, wait: Callable[[], Any], iters: int) -> dict[str, float]:
    """Median host us of each call made right after `wait`, the calls taken in turn (the
    bench's `host_times`, its synchronize replaced by `wait`)."""
    times = host_times(SimpleNamespace(synchronize=wait), calls, iters)  # type: ignore[arg-type]
    return {k: round(v * 1e6, 2) for k, v in times.items()}


def main() -> None:
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    calls, event, kept = device_calls(stream)
    calls.update(executor_calls())

    def spin() -> None:
        event.record()
        while not event.query():
            pass

    out = {
        "device": torch.cuda.get_device_name(),
        "synchronize": synced(calls, torch.cuda.synchronize, 1500),
        "stream_synchronize": synced(calls, stream.synchronize, 1500),
        "spin_on_event": synced(calls, spin, 1500),
        "back_to_back": {
            k: round(best_host_us(fn, 300, sync=torch.cuda.synchronize), 2)
            for k, fn in calls.items()
        },
    }
    for k in calls:
        print(k, {m: out[m][k] for m in out if m != "device"})
    write("sync-costs.json", out)
    del kept


if __name__ == "__main__":
    main()
