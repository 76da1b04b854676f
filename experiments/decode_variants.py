"""The reference model's decode step captured by hand under launch variants of the CUDA
adapter's decode kernels: replay time, kernels by name, and the race check of each PDL
variant against its baseline.

    OUT=out python experiments/decode_variants.py --model qwen3-0.6b --buckets 1,8,64 \\
        --variants plain,pdl,prefetch,pdl+prefetch,pdl+prefetch+early

A variant is a set of switches: `pdl` (the backend's PDL capture option), `prefetch` (the
projections ask L2 for their weights before they wait: XGRAPH_CUDA_PREFETCH), `early` (they
release their successor before they wait: XGRAPH_CUDA_PDL_TRIGGER; `end`: after their
product), `preload` (they load their first weight tile before they wait:
XGRAPH_CUDA_PRELOAD; `preload2`, `preload3`, `preload4`: their first two to four;
`preloadauto`: the default, two where a program walks at most four), `keys` (the decode
attention loads its first key tile before it waits: XGRAPH_CUDA_DECODE_PRELOAD),
`pipelined` (the float32
stream's launches at their configuration's stage count instead of `stages_for`'s one),
`qkvsplitN` (the qkv projection split N ways along K), `gemvsplitxN` (the other projections'
split N times the default), `warpsN` / `qkvwarpsN` (the projections' warps), `pdlmaxN`
(projections past N MiB of weights launch without PDL: XGRAPH_CUDA_PDL_MAX_MIB; `pdlmaxnone`
every one with it; the adapter's 64 unless named), `stagesN`
(the projections' pipeline stages), `cublasN`
(calls of N rows or more on cuBLAS with the fused ops around it: XGRAPH_CUDA_CUBLAS_ROWS;
65 unless named), `fmaN` (the projections other than qkv at one or two rows as unsplit
multiply-adds over N columns a program, `fmawarpsN` their warps; `wholeN` the same on the
tensor cores up to 16 rows), `downsplitN` (the down projection's K split set to N),
`upwarpsN` (the gate/up projection's warps), `attnsplitsN` / `attnblockN` / `attnwarpsN` /
`attnstagesN` (the decode attention's K/V splits, key tile, warps and pipeline stages).
Each is captured into its own graph (the switches are read at launch); per bucket and
variant: device us per replay (pdl_race.py's events over 50 replays, median of 5 rounds),
kernels of one replay by name (torch.profiler) for the first and last variant, and for PDL
variants the race check (`--replays` pairs against the same binaries launched without the
attribute). Writes `$OUT/decode-variants-<model>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
from contextlib import contextmanager
from typing import Any

import torch

import xgraph
from xgraph.attention import step_context
from xgraph.bench.anchors import static_inputs
from xgraph.bench.kernel_trace import _kernel_spans, split_steps, step_stats
from xgraph.bench.report import workload
from xgraph.pdl import race_check

# the PDL tool's capture (pdl / waits / plain) and replay timing, reused
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "adapters", "cuda", "tools"))
import pdl_race

ENV = {
    "prefetch": ("XGRAPH_CUDA_PREFETCH", "on", "off"),
    "early": ("XGRAPH_CUDA_PDL_TRIGGER", "early", "late"),
    "end": ("XGRAPH_CUDA_PDL_TRIGGER", "end", "late"),
    "preload": ("XGRAPH_CUDA_PRELOAD", "on", "off"),
    "preload2": ("XGRAPH_CUDA_PRELOAD", "2", "off"),
    "preload3": ("XGRAPH_CUDA_PRELOAD", "3", "off"),
    "preload4": ("XGRAPH_CUDA_PRELOAD", "4", "off"),
    "preloadauto": ("XGRAPH_CUDA_PRELOAD", "auto", "off"),
    "keys": ("XGRAPH_CUDA_DECODE_PRELOAD", "on", "off"),
}


@contextmanager
def pipelined(on: bool):
    """`pipelined`: the float32 stream's launches at their configuration's stage count, as
    before `stages_for` asked one stage for them (Triton then pipelines their loops)."""
    from xgraph_cuda import projection
    from xgraph_cuda.kernels import gemv  # its shared_options serves both kernels

    kept = gemv.stages_for
    if on:
        gemv.stages_for = lambda c, x, w: c.stages
    projection.forget()  # recipes kept by the calls before were made another way
    try:
        yield
    finally:
        gemv.stages_for = kept
        projection.forget()


def _asked(parts: set[str], prefix: str) -> int | None:
    """N of the switch `prefixN` among the variant's parts, or None."""
    got = [
        int(p[len(prefix) :]) for p in parts if p.startswith(prefix) and p[len(prefix) :].isdigit()
    ]
    return got[0] if got else None


@contextmanager
def configs(parts: set[str]):
    """The projections' launch configurations changed by hand (`tuning.pick`'s otherwise):
    `qkvsplitN`, the qkv projection's K split set to N (a split need not be a power of two:
    the kernel masks an uneven K); `gemvsplitxN`, the other projections' split N times the
    default (up to 16, each program keeping two K tiles): more programs, more weight bytes in
    flight per SM; `warpsN` / `qkvwarpsN`, every projection's (the qkv kernel's) warps;
    `stagesN`, every projection's pipeline stages (a 16-bit input's: see `pipelined`);
    `fmaN`, the other projections at one or two rows as float32 multiply-adds over N
    columns a program and K tiles of 1024, unsplit (with `preload4` a program's whole slice
    is loaded before its wait: no partials to sum after it), `fmawarpsN` their warps;
    `wholeN`, the same on the tensor cores up to 16 rows; `downsplitN`, the down
    projection's split (K wider than N: no other projection) set to N; `upwarpsN`, the
    gate/up projection's warps."""
    from xgraph_cuda import projection
    from xgraph_cuda.kernels.tuning import MAX_SPLIT, Config, block_m_for

    qkv, times = _asked(parts, "qkvsplit"), _asked(parts, "gemvsplitx")
    warps, qkv_warps = _asked(parts, "warps"), _asked(parts, "qkvwarps")
    stages = _asked(parts, "stages")
    fma, fma_warps = _asked(parts, "fma"), _asked(parts, "fmawarps")
    whole, down = _asked(parts, "whole"), _asked(parts, "downsplit")
    up_warps = _asked(parts, "upwarps")
    kept = projection.pick

    def pick(m, n, k, sms, head_dim=None):
        c = kept(m, n, k, sms, head_dim)
        c = c._replace(warps=warps or c.warps, stages=stages or c.stages)
        if head_dim is not None:
            return c._replace(split=qkv or c.split, warps=qkv_warps or c.warps)
        if fma and m <= 2:  # whole-K slices of `fma` columns, no split, multiply-adds
            return Config(False, block_m_for(m, False), fma, 1024, 1, fma_warps or 4, 1)
        if whole and m <= 16:  # the same on the tensor cores
            return Config(True, block_m_for(m, True), whole, 1024, 1, fma_warps or 4, 1)
        if down and k > n:  # the down projection alone (its K is the widest)
            return c._replace(split=down)
        if up_warps and n > k:  # gate/up alone (qkv, also wider than K, returned above)
            return c._replace(warps=up_warps)
        split = c.split
        while (
            times and split < c.split * times and split < MAX_SPLIT and k >= 4 * c.block_k * split
        ):
            split *= 2
        return c._replace(split=split)

    projection.pick = pick
    projection.forget()  # recipes kept by the calls before were made another way
    try:
        yield
    finally:
        projection.pick = kept
        projection.forget()


@contextmanager
def attention(parts: set[str]):
    """The decode attention's launch changed by hand (the runner's choice otherwise):
    `attnsplitsN` its K/V splits (the splits merging themselves, as the runner's own split
    launches do), `attnblockN` its key tile, `attnwarpsN`, `attnstagesN`."""
    from xgraph_cuda import triton_runners
    from xgraph_cuda.kernels import arena

    splits, block = _asked(parts, "attnsplits"), _asked(parts, "attnblock")
    warps, stages = _asked(parts, "attnwarps"), _asked(parts, "attnstages")
    kept = triton_runners.paged_decode

    def launch(q, kv, seq_lens, tables, out, scale, s, n, **kw):
        s, n = splits or s, block or n
        kw["num_warps"] = warps or kw.get("num_warps", 4)
        kw["num_stages"] = stages or kw.get("num_stages", 2)
        if s > 1 and kw.get("store") is not None and kw.get("counts") is None:
            kw["counts"] = arena.counts(q.device)
        return kept(q, kv, seq_lens, tables, out, scale, s, n, **kw)

    if any((splits, block, warps, stages)):
        triton_runners.paged_decode = launch
    try:
        yield
    finally:
        triton_runners.paged_decode = kept


@contextmanager
def env_set(var: str, value: str):
    """`var` set to `value` until the block ends, then as it was."""
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old


def pdl_max(parts: set[str]):
    """`pdlmaxN`: XGRAPH_CUDA_PDL_MAX_MIB=N (projections past N MiB of weights launch without
    the PDL attribute); `pdlmaxnone`: every projection takes it. Without the switch, the
    adapter's default (64 MiB). Until 2026-12-07 a variant without it ran every edge, which
    at Qwen3-8B is not the executor's step (docs/results/LOG.md, that day's H200 entry)."""
    asked = [p[len("pdlmax") :] for p in parts if p.startswith("pdlmax")]
    return env_set("XGRAPH_CUDA_PDL_MAX_MIB", asked[0]) if asked else contextlib.nullcontext()


def cublas_rows(parts: set[str]):
    """`cublasN`: XGRAPH_CUDA_CUBLAS_ROWS=N (calls of N rows or more run cuBLAS with the
    fused ops around it); without it 65, the decode kernels for all their 64 rows."""
    return env_set("XGRAPH_CUDA_CUBLAS_ROWS", str(_asked(parts, "cublas") or 65))


@contextmanager
def switches(variant: str):
    parts = set(variant.split("+"))
    old = {v[0]: os.environ.get(v[0]) for v in ENV.values()}
    for var, _, off in ENV.values():  # a variable two switches share: off unless one is on
        os.environ[var] = off
    for name, (var, on, _) in ENV.items():
        if name in parts:
            os.environ[var] = on
    try:
        with (
            pipelined("pipelined" in parts),
            configs(parts),
            pdl_max(parts),
            cublas_rows(parts),
            attention(parts),
        ):
            yield "pdl" in parts
    finally:
        for var, val in old.items():
            if val is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = val


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Median of 5 rounds of the PDL tool's timing (events over its replays)."""
    return statistics.median(pdl_race.replay_us(graph) for _ in range(5))


def kernels_of(graph, steps: int = 3) -> dict[str, Any]:
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
            torch.cuda.synchronize()
    per = split_steps(_kernel_spans(prof), steps)
    one = per[len(per) // 2]
    names: dict[str, list[float]] = {}
    for s, e, n in one:
        names.setdefault(n[:90], []).append(e - s)
    table = sorted(((sum(v), len(v), n) for n, v in names.items()), reverse=True)
    return {
        "stats": step_stats(one),
        "by_name": [{"name": n, "count": c, "us": round(t, 2)} for t, c, n in table],
        "sequence": [[round(s - one[0][0], 2), round(e - s, 2), n[:40]] for s, e, n in one],
    }


def bucket(
    backend, w, b: int, variants: list[str], replays: int, profile_all: bool = False
) -> dict[str, Any]:
    kernels = backend.activate()
    step = w.decode_step(random.Random(b), b, max_context=256).with_tensor_tables(
        w.max_blocks, w.cache.dummy_block
    )
    ids, pos, ctx, _ = static_inputs(backend, w, step)

    def forward():
        with torch.no_grad(), step_context(ctx):
            return w.model.forward(ids, pos)

    g = torch.Generator(device="cuda").manual_seed(b)
    vocab = w.model.config.vocab_size

    def feed(i: int) -> None:
        ids.copy_(torch.randint(0, vocab, ids.shape, device="cuda", generator=g))

    def run(graph, out):
        return lambda: (graph.replay(), torch.cuda.synchronize(), [out])[2]

    rows: dict[str, Any] = {}
    for i, v in enumerate(variants):
        with switches(v) as pdl:
            graph, out, edges = pdl_race.capture(forward, kernels, "pdl" if pdl else "plain")
            row: dict[str, Any] = {"edges": edges, "us": replay_us(graph)}
            if profile_all or i in (0, len(variants) - 1):
                row["kernels"] = kernels_of(graph)
            if pdl and replays:
                base, bout, _ = pdl_race.capture(forward, kernels, "waits")
                rep = race_check(run(graph, out), run(base, bout), feed, replays, b)
                row["race"] = {
                    "replays": replays,
                    "mismatches": rep.mismatches,
                    "verdict": rep.describe(),
                }
        name = v if v not in rows else f"{v} (again)"  # a repeat keeps the first's row
        rows[name] = row
        print(b, name, {k: row[k] for k in row if k != "kernels"}, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--buckets", default="1,8,64")
    p.add_argument("--variants", default="plain,pdl,prefetch,pdl+prefetch,pdl+prefetch+early")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--profile-all", action="store_true", help="kernels of every variant")
    a = p.parse_args(argv)
    backend = xgraph.get_backend("cuda")
    buckets = [int(x) for x in a.buckets.split(",")]
    w = workload(backend, a.model, max_seqs=max(buckets), context=512)
    out = {
        "model": a.model,
        "device": torch.cuda.get_device_name(),
        "buckets": {
            b: bucket(backend, w, b, a.variants.split(","), a.replays, a.profile_all)
            for b in buckets
        },
    }
    for b, rows in out["buckets"].items():
        for v, r in rows.items():
            if "kernels" in r:
                print(f"--- {a.model} b={b} {v}: {r['kernels']['stats']}")
                for k in r["kernels"]["by_name"][:14]:
                    print(f"   {k['us']:8.1f} us  x{k['count']:3d}  {k['name']}")
    path = os.path.join(os.environ.get("OUT", "."), f"decode-variants-{a.model}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
