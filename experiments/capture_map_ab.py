"""The reference model's 93 captures (51 decode sizes, 42 piecewise) with the pool mapping a
capture's range in one run (`run`: `VirtualMemory.map_run`, every existing chunk at the
first growth), one run per growth of only the chunks it needs (`need`), and one map per
chunk as each segment asks (`chunk`: the pool before map_run), sessions
alternating in one process (a host's speed moves by a third between processes).

    OUT=out python experiments/capture_map_ab.py --rounds 3

Prints and writes $OUT/capture-map-ab.json: seconds of each session and chunk maps per
session, per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from xgraph.bench import startup_run as sr
from xgraph.bench.capture_profile import _warm_executors
from xgraph.buckets import sglang_piecewise_sizes, vllm_capture_sizes
from xgraph.errors import XGraphError
from xgraph.models import Qwen3Model
from xgraph.plugins import get_backend
from xgraph.pool import SharedPhysicalPool

RUN = SharedPhysicalPool.grow


def per_chunk(self: SharedPhysicalPool, space, nbytes: int) -> int:  # type: ignore[no-untyped-def]
    """The pool's growth before map_run: one map per chunk, as each segment asks."""
    with self._lock:
        size = -(-nbytes // self.chunk_size) * self.chunk_size
        start, end = space.cursor, space.cursor + size
        if end > space.size:
            raise XGraphError("capture needs more address space")
        while space.mapped < end // self.chunk_size:
            k = space.mapped
            if k == len(self.chunks):
                self.chunks.append(self.vm.create(self.chunk_size))
                space.created.append(k)
            self.vm.map(space.base + k * self.chunk_size, self.chunks[k])
            self.map_calls += 1
            space.mapped += 1
        space.cursor = end
        self.high_water = max(self.high_water, end)
        return space.base + start


def need_only(self: SharedPhysicalPool, space, nbytes: int) -> int:  # type: ignore[no-untyped-def]
    """One run per growth, but only of the chunks this growth needs (no mapping ahead)."""
    with self._lock:
        size = -(-nbytes // self.chunk_size) * self.chunk_size
        start, end = space.cursor, space.cursor + size
        if end > space.size:
            raise XGraphError("capture needs more address space")
        need = end // self.chunk_size
        if space.mapped < need:
            while len(self.chunks) < need:
                chunk = self.vm.create(self.chunk_size)
                space.created.append(len(self.chunks))
                self.chunks.append(chunk)
            run = self.chunks[space.mapped : need]
            self.vm.map_run(space.base + space.mapped * self.chunk_size, run)
            self.map_calls += len(run)
            space.mapped = need
        space.cursor = end
        self.high_water = max(self.high_water, end)
        return space.base + start


VARIANTS = {"run": RUN, "chunk": per_chunk, "need": need_only}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--max-decode", type=int, default=512)
    p.add_argument("--max-piece", type=int, default=2048)
    args = p.parse_args()
    backend = get_backend(args.backend)
    decode = vllm_capture_sizes(args.max_decode)
    pieces = sglang_piecewise_sizes(args.max_piece)
    dtype = torch.float32 if backend.device.type == "cpu" else torch.bfloat16
    model = Qwen3Model.build(args.model, num_blocks=1, dtype=dtype, device=backend.device)
    sr._kv_cache(model, backend, decode, pieces)
    out: dict[str, dict[str, list]] = {v: {"seconds": [], "maps": []} for v in VARIANTS}
    for _ in range(args.rounds):
        for name in out:
            SharedPhysicalPool.grow = VARIANTS[name]  # type: ignore[method-assign]
            full, pw = _warm_executors(backend, model, decode, pieces)
            t0 = time.perf_counter()
            sr._capture_all(full, pw)
            out[name]["seconds"].append(time.perf_counter() - t0)
            out[name]["maps"].append(full.memory.physical.map_calls)
            sr._close([full, pw])
    SharedPhysicalPool.grow = RUN  # type: ignore[method-assign]
    for name, r in out.items():
        print(name, " ".join(f"{t:.2f}" for t in r["seconds"]), "s; maps", r["maps"])
    with open(os.path.join(os.environ.get("OUT", "."), "capture-map-ab.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
