"""Skinny linear against cuBLAS, inside CUDA graphs, on the reference model's projections.

    python adapters/cuda/tools/probe_skinny_linear.py out.json [sweep,step,chain] [--model M]

For each projection of the reference shape (qkv, o, gate_up, down) and each row count
1, 4, 8, 16: 28 distinct weights (one per layer, so nothing stays in L2) are applied in one
captured graph, cuBLAS (F.linear) against the skinny Triton kernel with its picked tiles
and with every tile configuration of a sweep. Device time per call from CUDA events over
graph replays. A last section replays a whole step's projections (the four per layer, in
layer order): cuBLAS, the kernel's picked tiles, and the sweep's best tiles per projection.
Each row also records the kernel's largest error against F.linear (bf16). The `chain`
section runs the projections as a dependent chain with torch's norm and SwiGLU kernels
between them.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from xgraph_cuda.kernels import skinny

from xgraph.models import Qwen3Config

LAYERS, REPS = 28, 20
ROWS = (1, 4, 8, 16)


def graph_us(fn: Callable[[], None], calls: int) -> float:
    """Device us per call of `fn` (which makes `calls` calls), replayed in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(REPS):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (REPS * calls)


def each(fn: Callable, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    """A callable applying fn(x, w) to every pair in turn."""
    return lambda: [fn(x, w) for x, w in pairs]  # type: ignore[func-returns-value]


def each_own(fns: list[Callable], pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    """A callable applying fns[i](x, w) to pairs[i], in order."""
    return lambda: [f(x, w) for f, (x, w) in zip(fns, pairs)]


def sweep_configs(m: int) -> list[skinny.Config]:
    """Tiles: columns a program, K a step, pipeline stages; product tiles of at most 16384
    float32 values. (Two more variants of the kernel, one sum over K at the end and a
    tensor-core dot with the rows padded to 16, were swept this way and won nothing.)"""
    bm = 1 << (m - 1).bit_length()
    return [
        skinny.Config(bn, bk, 4, st)
        for bn, bk, st in itertools.product((2, 4, 8, 16), (256, 512, 1024), (2, 4))
        if bm * bn * bk <= 16384
    ]


def projections(c: Qwen3Config) -> dict[str, tuple[int, int]]:
    h, d = c.hidden_size, c.head_dim
    return {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * d, h),
        "o": (h, c.num_heads * d),
        "gate_up": (2 * c.intermediate_size, h),
        "down": (h, c.intermediate_size),
    }


def sweep(out: dict, path: str, shapes: dict, weights: dict) -> dict:
    """Per row count and projection: cuBLAS, picked tiles, every swept tile; the best."""
    best: dict[tuple[int, str], skinny.Config] = {}
    for m in ROWS:
        for s, (n, k) in shapes.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ws = weights[s]
            err = (skinny.skinny_linear(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs()
            row: dict = {"m": m, "shape": s, "n": n, "k": k, "max_abs_err": err.max().item()}
            pairs = [(x, w) for w in ws]
            row["cublas_us"] = graph_us(each(F.linear, pairs), LAYERS)
            row["picked"] = list(skinny.pick(m, n, k))
            row["picked_us"] = graph_us(each(skinny.skinny_linear, pairs), LAYERS)
            timed = []
            for cfg in sweep_configs(m):
                tiled = functools.partial(skinny.skinny_linear, config=cfg)
                try:
                    timed.append((graph_us(each(tiled, pairs), LAYERS), list(cfg)))
                except OutOfResources:  # tiles too large for shared memory: not a candidate
                    torch.cuda.synchronize()
            timed.sort()
            row["best"] = timed[:5]
            best[m, s] = skinny.Config(*timed[0][1])
            out["rows"].append(row)
            print(
                f"m={m} {s:8s} cublas {row['cublas_us']:6.2f} picked {row['picked_us']:6.2f} "
                f"best {timed[0][0]:6.2f} {timed[0][1]} err {row['max_abs_err']:.3g}",
                flush=True,
            )
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    return best


def step(shapes: dict, weights: dict, best: dict) -> dict:
    """A step's projections (four per layer, independent inputs): cuBLAS, picked, best."""
    steps = {}
    for m in ROWS:
        xs = {
            s: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for s, (n, k) in shapes.items()
        }
        order = list(itertools.product(range(LAYERS), shapes))
        pairs = [(xs[s], weights[s][i]) for i, s in order]
        tuned = [functools.partial(skinny.skinny_linear, config=best[m, s]) for _, s in order]
        steps[m] = {
            "cublas_us": graph_us(each(F.linear, pairs), 1),
            "picked_us": graph_us(each(skinny.skinny_linear, pairs), 1),
            "best_us": graph_us(each_own(tuned, pairs), 1),
        }
        print(f"step m={m}: {steps[m]}", flush=True)
    return steps


def served(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel where it serves the call, else cuBLAS (what `xgraph.linear` does)."""
    y = skinny.linear(x, w)
    return F.linear(x, w) if y is None else y


def layers(lin: Callable, h0: torch.Tensor, weights: dict, c: Qwen3Config) -> torch.Tensor:
    """The projections of every layer as a dependent chain, with torch's norm and SwiGLU
    kernels between them, as in the model (attention left out: q's first half goes to o)."""
    h = h0
    q = c.num_heads * c.head_dim
    for i in range(LAYERS):
        a = F.rms_norm(h, (h.shape[-1],))
        o = lin(lin(a, weights["qkv"][i])[:, :q], weights["o"][i])
        g = lin(F.rms_norm(o + h, (h.shape[-1],)), weights["gate_up"][i])
        h = lin(
            F.silu(g[:, : c.intermediate_size]) * g[:, c.intermediate_size :], weights["down"][i]
        )
    return h


def chain(weights: dict, c: Qwen3Config) -> dict:
    """The dependent chain per row count, cuBLAS against the kernel where it serves.
    (Launching the kernel as a programmatic dependent, PDL, measured slower in this chain.)"""
    res = {}
    for m in (1, 4):
        h0 = torch.randn(m, c.hidden_size, device="cuda", dtype=torch.bfloat16)
        row = {}
        for name, lin in (("cublas", F.linear), ("skinny", served)):
            row[f"{name}_us"] = graph_us(functools.partial(layers, lin, h0, weights, c), 1)
        res[m] = row
        print(f"chain m={m}: {row}", flush=True)
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="write the results here (rewritten as the sweep goes)")
    p.add_argument(
        "sections",
        nargs="?",
        default="sweep,step,chain",
        help="comma list of sweep, step (needs sweep), chain",
    )
    p.add_argument("--model", default="qwen3-0.6b", help="the reference shape")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_skinny_linear: needs a CUDA GPU; torch.cuda.is_available() is False.")
        return 2
    path = args.json
    sections = args.sections.split(",")
    c = Qwen3Config.named(args.model)
    shapes = projections(c)
    weights = {
        s: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        for s, (n, k) in shapes.items()
    }
    out: dict = {"device": torch.cuda.get_device_name(), "rows": []}
    if "sweep" in sections:
        best = sweep(out, path, shapes, weights)
        if "step" in sections:
            out["step"] = step(shapes, weights, best)
    if "chain" in sections:
        out["chain"] = chain(weights, c)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
