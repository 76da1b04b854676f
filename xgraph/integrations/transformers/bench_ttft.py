"""Time to first token of the transformers benchmark: xgraph against transformers' generate().

Each case is a batch of equal prompts, `N x L` (N prompts of L tokens), all arriving at
once: xgraph's time is the largest time to first token of the batch (the Engine's: from
`add` to the host having the token; every prompt's prefill runs in the same piecewise
step when the step budget holds them); transformers' the wall time of `generate(...,
max_new_tokens=1)` on the batch, synchronized, same weights, with the static cache of the
decode comparison. Each is the best of `iters` runs after a warm-up run (which captures
the graphs and compiles what either side compiles).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ...errors import XGraphError
from .bench_runs import random_prompts, transformers_generate_kwargs
from .model import GraphModel


def parse_cases(text: str) -> list[tuple[int, int]]:
    """ "1x2048,16x128" -> [(1, 2048), (16, 128)] (prompts x tokens)."""
    cases = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            n, length = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise XGraphError(f"--ttft {text!r}: give cases such as 1x2048,16x128") from None
        if n < 1 or length < 1:
            raise XGraphError(f"--ttft {text!r}: counts and lengths must be positive")
        cases.append((n, length))
    return cases


def xgraph_ttft(gm: GraphModel, n: int, length: int, iters: int) -> dict[str, Any]:
    prompts = random_prompts(gm.spec.vocab_size, [length] * n, seed=3)
    best: dict[str, Any] = {}
    for i in range(iters + 1):
        r = gm.generate(prompts, 1)
        ttft = max(r.ttft)
        if i and ttft < best.get("ttft_s", float("inf")):
            best = {"ttft_s": ttft, "steps": r.steps, "graph_steps": r.graph_steps}
    return best


def transformers_ttft(
    reference: Any, n: int, length: int, iters: int, compile: bool
) -> dict[str, Any]:
    device = next(reference.parameters()).device
    ids = torch.tensor(random_prompts(reference.config.vocab_size, [length] * n, seed=3))
    ids = ids.to(device)
    kwargs = transformers_generate_kwargs(ids, 1, compile)
    best = float("inf")
    for i in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            reference.generate(ids, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return {"ttft_s": best, "compile": compile}


def run_ttft(
    gm: GraphModel, reference: Any, cases: list[tuple[int, int]], iters: int, compile: bool
) -> list[dict[str, Any]]:
    rows = []
    for n, length in cases:
        x = xgraph_ttft(gm, n, length, iters)
        t = transformers_ttft(reference, n, length, iters, compile)
        ratio = t["ttft_s"] / x["ttft_s"] if x.get("ttft_s") else None
        rows.append({"case": f"{n}x{length}", "xgraph": x, "transformers": t, "speedup": ratio})
    return rows
