"""What the host-time probes share: the reference model's decode steps per bucket (as
`xgraph bench decode` makes them), a call's best host time over rounds, and writing a
probe's JSON under $OUT."""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

import xgraph
from xgraph.bench.report import workload


def decode_workload(model: str, buckets: list[int]):  # type: ignore[no-untyped-def]
    """(backend, workload, {bucket: decode step with tensor block tables})."""
    backend = xgraph.get_backend(os.environ.get("XGRAPH_BACKEND", "cuda"))
    w = workload(backend, model, max_seqs=max(buckets), context=512)
    rng = random.Random(0)
    steps = {
        b: w.decode_step(rng, b, max_context=256).with_tensor_tables(
            w.max_blocks, w.cache.dummy_block
        )
        for b in buckets
    }
    return backend, w, steps


def best_host_us(
    fn: Callable[[], Any],
    calls: int,
    rounds: int = 5,
    warm: int = 20,
    sync: Callable[[], Any] | None = None,
) -> float:
    """Host us per call of `fn`: the best of `rounds` rounds of `calls` calls after `warm`
    to warm up; `sync` (a device synchronize) drains the queue before the rounds and after
    each, outside the timed window."""
    drain = sync or (lambda: None)
    drain()
    for _ in range(warm):
        fn()
    drain()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        drain()
    return best


def write(name: str, data: dict) -> None:
    path = os.path.join(os.environ.get("OUT", "out"), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def parser() -> argparse.ArgumentParser:
    """--model, --buckets and --iters, as every probe takes them."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--buckets", default="1,8,64")
    p.add_argument("--iters", type=int, default=200)
    return p


def buckets_of(a: argparse.Namespace) -> list[int]:
    return [int(b) for b in a.buckets.split(",")]
