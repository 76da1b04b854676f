"""Programmatic dependent launch over the reference model's decode step: the programmatic
edges of its graph, its replay time with and without, and the race check.

    python adapters/cuda/tools/pdl_race.py --model qwen3-0.6b --buckets 1,8,64 \\
        --replays 200 --json out/pdl-race.json

For each bucket, the forward (eager, the backend's kernels installed, one decode step on
static inputs) is captured three times with torch.cuda.CUDAGraph(keep_graph=True): inside
the backend's PDL capture option (`xgraph.pdl.capture_options(kernels, "full", True)`, the
warm-up too: `pdl`), with the same kernel binaries launched without the PDL attribute
(`waits`: the race check's baseline, differing from `pdl` by the launch attribute alone),
and as the backend launches them without PDL (`plain`). It records each graph's
programmatic edges and the device time of a replay of each (events over 50 replays), then
`xgraph.pdl.race_check` of `pdl` against `waits`: `--replays` pairs of replays, new token
ids before each pair, the hidden states compared bit for bit; and whether `waits` and
`plain` agree bit for bit over 5 replays (the compiled-in wait changes no arithmetic).
The JSON's `buckets`, `replays` and `mismatches` are what docs/results/h200/
decode-limit.json keeps as `pdl_race_check` (python -m xgraph.bench.limit --race).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

import torch

import xgraph
from xgraph.attention import step_context
from xgraph.bench.anchors import static_inputs
from xgraph.bench.report import workload
from xgraph.pdl import capture_options, race_check

REPS = 50


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(REPS):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / REPS


def mode(kernels: Any, name: str) -> Any:
    """The capture context of a mode: pdl (the core's option), waits, plain."""
    if name == "plain":
        return capture_options(kernels, "full", False)
    return capture_options(kernels, "full", name == "pdl", baseline=name == "waits")


def capture(forward: Any, kernels: Any, name: str) -> tuple[torch.cuda.CUDAGraph, Any, Any]:
    """The forward captured in a mode: (graph, its output, its programmatic edges)."""
    with mode(kernels, name):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            forward()  # warm-up under the same option: the launch variants compile here
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            out = forward()
    edges = kernels.pdl.programmatic_edges(graph) if kernels.pdl is not None else None
    return graph, out, edges


def bucket(backend: Any, w: Any, b: int, replays: int, seed: int) -> dict[str, Any]:
    kernels = backend.activate()
    step = w.decode_step(random.Random(seed + b), b, max_context=256).with_tensor_tables(
        w.max_blocks, w.cache.dummy_block
    )
    ids, pos, ctx, _ = static_inputs(backend, w, step)

    def forward() -> torch.Tensor:
        with torch.no_grad(), step_context(ctx):
            return w.model.forward(ids, pos)

    graphs = {name: capture(forward, kernels, name) for name in ("pdl", "waits", "plain")}
    out: dict[str, Any] = {"bucket": b}
    for name, (graph, _, edges) in graphs.items():
        out[f"edges_{name}"], out[f"{name}_us"] = edges, replay_us(graph)
    g = torch.Generator(device="cuda").manual_seed(seed)
    vocab = w.model.config.vocab_size

    def feed(i: int) -> None:
        ids.copy_(torch.randint(0, vocab, ids.shape, device="cuda", generator=g))

    def run(graph: torch.cuda.CUDAGraph, result: torch.Tensor) -> Any:
        return lambda: (graph.replay(), torch.cuda.synchronize(), [result])[2]

    on, base, plain = (run(*graphs[n][:2]) for n in ("pdl", "waits", "plain"))
    report = race_check(on, base, feed, replays, b)
    out.update(mismatches=report.mismatches, clean=report.clean, verdict=report.describe())
    out["waits_change_no_bits"] = race_check(base, plain, feed, 5, b).clean
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--buckets", default="1,8,64")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("pdl_race: needs a CUDA GPU; torch.cuda.is_available() is False.")
        return 2
    backend = xgraph.get_backend("cuda")
    buckets = [int(b) for b in args.buckets.split(",") if b]
    w = workload(backend, args.model, max_seqs=max(buckets), context=512)
    rows = []
    for b in buckets:
        try:
            rows.append(bucket(backend, w, b, args.replays, args.seed))
        except Exception as exc:  # one bucket's failure is reported, the others still run
            rows.append({"bucket": b, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    data = {"model": args.model, "buckets": buckets, "replays": args.replays}
    data["mismatches"] = sum(r.get("mismatches", 0) for r in rows)
    data["programmatic_edges"] = {r["bucket"]: r.get("edges_pdl") for r in rows}
    data["rows"] = rows
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    cols = ["bucket", "edges_pdl", "edges_plain", "pdl_us", "waits_us", "plain_us"]
    cols += ["mismatches", "waits_change_no_bits"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [r.get(k, r.get("error", "")) for k in cols]
        print(
            "| " + " | ".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells) + " |"
        )
    return 0 if all(r.get("clean") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
