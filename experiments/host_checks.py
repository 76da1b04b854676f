"""The value checks of a decode step's host metadata, move by move, per batch: host us of
the token inputs' check, the attention inputs' check (whole, the views of its host fields,
and `DecodeCheck.passes`, the decode step's few-call check), the planner's check, decide and
stage, and a whole executor step over a trivial forward. Each the best of 7 rounds of
`--calls` calls, the moves called on their own (a measurement of the internals, as `xgraph
bench host`'s phases are). Runs on any backend, the CPU's too:

    OUT=out python experiments/host_checks.py --backend cpu --batches 1,8,64

Writes `$OUT/host-checks.json`.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

from probe_common import best_host_us, write

import xgraph
from xgraph.bench.host import _trivial, cpu_name
from xgraph.bench.report import workload
from xgraph.step_fields import host_fields


def best_us(fn: Callable[[], Any], calls: int) -> float:
    """Host us per call: the best of 7 rounds of `calls` calls, after 50 to warm up."""
    return best_host_us(fn, calls, rounds=7, warm=50)


def row(ex: Any, step: Any, calls: int) -> dict[str, Any]:
    b, p = step.num_tokens, ex.planner
    ex(**step.kwargs())  # this batch's graph captured
    inputs = {"input_ids": step.input_ids, "positions": step.positions}
    attn, ac = step.attn, p.attn_check
    sl, table, slots = host_fields(attn.seq_lens, attn.block_tables, attn.slot_mapping, ac.width)
    checked = p.check(inputs, attn)
    decision = p.decide(checked)
    moves: dict[str, Callable[[], Any]] = {
        "tokens": lambda: p.tokens.check(inputs),
        "attention": lambda: ac.check(attn, b),
        "host_fields": lambda: host_fields(
            attn.seq_lens, attn.block_tables, attn.slot_mapping, ac.width
        ),
        "decode_passes": lambda: ac.decode.passes(sl, table, slots),
        "check": lambda: p.check(inputs, attn),
        "decide": lambda: p.decide(checked),
        "stage": lambda: p.stage(checked, decision),
    }
    out = {"batch": b, **{f"{k}_us": round(best_us(fn, calls), 2) for k, fn in moves.items()}}
    out["step_us"] = round(best_us(lambda: ex(**step.kwargs()), max(1, calls // 3)), 2)
    return out


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--backend", default="cpu")
    a.add_argument("--batches", default="1,8,64")
    a.add_argument("--calls", type=int, default=3000)
    args = a.parse_args()
    backend = xgraph.get_backend(args.backend)
    batches = [int(x) for x in args.batches.split(",")]
    w = workload(backend, "tiny", max_seqs=max(batches), context=512)
    ex = w.executor(_trivial, backend=backend, buckets=batches)
    rng = random.Random(0)
    rows = []
    for b in batches:  # block tables 512 tokens wide, contexts up to 256: bench host's steps
        step = w.decode_step(rng, b, max_context=256)
        rows.append(row(ex, step.with_tensor_tables(w.max_blocks, w.cache.dummy_block), args.calls))
        print(rows[-1])
    ex.close()
    out = {"backend": args.backend, "cpu": cpu_name(), "calls": args.calls, "rows": rows}
    write("host-checks.json", out)


if __name__ == "__main__":
    main()
