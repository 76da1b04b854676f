"""What the host-time probes share: the reference model's decode steps per bucket (as
`xgraph bench decode` makes them) and writing a probe's JSON under $OUT."""

from __future__ import annotations

import argparse
import json
import os
import random

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
