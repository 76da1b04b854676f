"""Host microseconds of each piece of a decode step's planning (diagnostic), on any backend:
the decode path's checks, writes and copy, one by one, on the `bench host` workload.
JSON to argv[1]; argv[2] the backend (default: the best available).

    python scripts/probe_plan_costs.py out.json [BACKEND]
"""

from __future__ import annotations

import json
import platform
import random
import sys
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

import xgraph
import xgraph.validation as V
from xgraph.bench.host import _trivial, cpu_name
from xgraph.bench.report import workload


def us(fn: Callable[[], Any], n: int = 2000) -> float:
    """Best of five means of n calls, in microseconds (the floor of each piece)."""
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def pieces(ex: Any, step: Any, n: int) -> dict[str, float]:
    p = ex.planner
    d, dc = p.decode, p.decode.attention
    inputs = {"input_ids": step.input_ids, "positions": step.positions}
    attn = step.attn
    checked = d.validate(inputs, attn)
    bucket = d.bucket(n)
    da = checked[3]
    rows = dc.stage(da, n, n)
    t = step.input_ids
    a = t.numpy()
    return {
        "tensor.numpy()": us(t.numpy),
        "numpy compare+count (ids)": us(lambda: V._count(a.view(np.uint64) >= 7)),
        "tokens.check": us(lambda: d.tokens.check(inputs)),
        "int64(seq_lens)": us(lambda: V._int64(attn.seq_lens, False)),
        "int64(slots)": us(lambda: V._int64(attn.slot_mapping, True)),
        "decode.check": us(lambda: dc.check(attn, n)),
        "validate": us(lambda: d.validate(inputs, attn)),
        "table stage": us(lambda: dc.stage(da, n, n)),
        "check_staged": us(lambda: dc.check_staged(da, rows)),
        "stage_attention": us(lambda: d._stage_attention(da, n, bucket)),
        "stage (with send)": us(lambda: d.stage(checked, bucket)),
        "send": us(lambda: d.staged.send(bucket.plan.nbytes)),
        "wait (done)": us(d.staged.begin),
        "plan": us(lambda: p.plan(inputs, attn)),
    }


def main(path: str, backend_name: str | None) -> None:
    backend = xgraph.get_backend(backend_name)
    w = workload(
        backend, "qwen3-0.6b" if backend.device.type != "cpu" else "tiny", max_seqs=256, context=512
    )
    ex = w.executor(_trivial, backend=backend, buckets=[1, 8, 64, 256])
    rng = random.Random(0)
    out: dict[str, Any] = {
        "backend": backend.name,
        "cpu": cpu_name(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "us": {},
    }
    for n in (1, 256):
        step = w.decode_step(rng, n, max_context=256).with_tensor_tables(
            w.max_blocks, w.cache.dummy_block
        )
        ex(**step.kwargs())
        backend.synchronize()
        out["us"][n] = pieces(ex, step, n)
    ex.close()
    print(f"{out['cpu']} / python {out['python']} / numpy {out['numpy']}")
    for k in out["us"][1]:
        print(f"{k:28s} {out['us'][1][k]:7.2f} {out['us'][256][k]:7.2f}")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "plan-costs.json",
        sys.argv[2] if len(sys.argv) > 2 else None,
    )
