"""Micro-benchmark of the CUDA adapter's attention runners (GPU only).

Decode: the core's reference runner against the Triton runner, batch 1/8/64/256, 512-token
contexts in block tables 512 and 4096 tokens wide; timed eagerly and as CUDA-graph replays.
Prefill: the SDPA runner against the Triton runner at 1x2048, 16x8 and 16x128 tokens (plus a
512-token chunk after 1536 tokens of context), with dense SDPA (no paging) as the anchor for
single sequences; eager (what a step pays, host included) and replayed from a graph of the
planned step (device time). Qwen3-0.6B attention shapes (16 q heads, 8 kv heads, dim 128), bf16,
16-token blocks. Times are per runner call (one layer), from torch.cuda.Event pairs.

    python adapters/cuda/tools/bench_attention.py --json out/attention.json

Every row runs on its own: a failure is recorded in its row and the rest still run; after a
sticky CUDA error (the context is lost) the remaining rows run in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from xgraph.metadata import AttentionMetadata
from xgraph.runners import PagedDecodeRunner

HQ, HKV, DIM, BLOCK = 16, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
GRAPH_CALLS = 20  # runner calls per captured graph (like layers), so replay launch cost fades
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXT = 512
DECODE_TABLES = (512, 4096)
PREFILL_CASES: dict[str, tuple[list[int], list[int]]] = {
    "1x2048": ([2048], [2048]),
    "16x8": ([8] * 16, [8] * 16),
    "16x128": ([128] * 16, [128] * 16),
    "1x512+1536ctx": ([512], [2048]),
}


@dataclass
class Row:
    id: str
    kind: str
    case: str
    runner: str
    eager_us: float | None = None
    graph_us: float | None = None
    plan_us: float | None = None
    max_abs_err: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# -- timing --------------------------------------------------------------------------------


def time_calls(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Microseconds per call of `fn`, launch gaps included (what an eager step pays)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_graph(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph holding GRAPH_CALLS calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    per_replay = time_calls(graph.replay, warmup, iters)
    del graph
    return per_replay / GRAPH_CALLS


def time_host(fn: Callable[[], Any], iters: int) -> float:
    """Microseconds of host wall time per call (work it queues finished each time)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / iters


# -- steps ---------------------------------------------------------------------------------


def paged_step(
    query_lens: list[int], seq_lens: list[int], width_tokens: int, seed: int = 0
) -> tuple[AttentionMetadata, tuple[torch.Tensor, ...], torch.Tensor]:
    """A step's metadata, (q, k, v) and a [2, blocks + 1, BLOCK, HKV, DIM] cache on the GPU:
    blocks shuffled, table columns past each context pointing at the last (dummy) block."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(pages)
    width = max(width_tokens // BLOCK, max(pages))
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq_lens), width), num_blocks, dtype=torch.int32)
    slots, used = [], 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        table[i, : pages[i]] = perm[used : used + pages[i]]
        used += pages[i]
        row = table[i].tolist()
        slots += [row[p // BLOCK] * BLOCK + p % BLOCK for p in range(sl - ql, sl)]
    md = AttentionMetadata.build(query_lens, seq_lens, table, slots, device=DEVICE)
    n = sum(query_lens)
    qkv = tuple(torch.randn(n, h, DIM, generator=g).to(DEVICE, DTYPE) for h in (HQ, HKV, HKV))
    cache = torch.randn(2, num_blocks + 1, BLOCK, HKV, DIM, generator=g).to(DEVICE, DTYPE)
    return md, qkv, cache


def runner_call(
    runner: Any, md: AttentionMetadata, qkv: tuple[torch.Tensor, ...], cache: torch.Tensor
) -> tuple[Callable[[], None], torch.Tensor]:
    """A zero-argument call of `runner` on the planned step, and the tensor it writes."""
    q, k, v = qkv
    out = torch.empty_like(q)
    runner.plan(md)
    kv = (cache[0], cache[1])
    return lambda: runner.run(q, k, v, out, kv, DIM**-0.5), out


# -- rows ----------------------------------------------------------------------------------


def make_runner(name: str) -> Any:
    if name == "reference":
        return PagedDecodeRunner()
    if name == "sdpa":
        from xgraph_cuda.attention import SDPAPrefillRunner

        return SDPAPrefillRunner()
    from xgraph_cuda.triton_runners import TritonPagedDecodeRunner, TritonVarlenPrefillRunner

    return TritonPagedDecodeRunner() if name == "triton-decode" else TritonVarlenPrefillRunner()


def decode_row(row: Row, batch: int, table: int, args: argparse.Namespace) -> None:
    md, qkv, cache = paged_step([1] * batch, [DECODE_CONTEXT] * batch, table)
    call, out = runner_call(make_runner(row.runner), md, qkv, cache)
    row.eager_us = time_calls(call, args.warmup, args.iters)
    row.graph_us = time_graph(call, args.warmup, args.iters)
    call()
    want_call, want = runner_call(PagedDecodeRunner(), md, qkv, cache.clone())
    want_call()
    row.max_abs_err = float((out.float() - want.float()).abs().max())
    row.extra["table_blocks"] = md.block_tables.shape[1]


def prefill_row(row: Row, case: str, args: argparse.Namespace) -> None:
    query_lens, seq_lens = PREFILL_CASES[case]
    md, qkv, cache = paged_step(query_lens, seq_lens, max(seq_lens))
    if row.runner == "sdpa-dense":
        dense_row(row, qkv, args)
        return
    runner = make_runner(row.runner)
    call, out = runner_call(runner, md, qkv, cache)
    row.eager_us = time_calls(call, args.warmup, args.iters)
    graph_time(row, call, args)
    row.plan_us = time_host(lambda: runner.plan(md), args.iters)
    call()
    want_call, want = runner_call(make_runner("sdpa"), md, qkv, cache.clone())
    want_call()
    row.max_abs_err = float((out.float() - want.float()).abs().max())


def dense_row(row: Row, qkv: tuple[torch.Tensor, ...], args: argparse.Namespace) -> None:
    """Causal SDPA on contiguous k/v of one fresh sequence: the kernel with no paging."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in qkv)

    def call() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    row.eager_us = time_calls(call, args.warmup, args.iters)
    graph_time(row, call, args)
    row.extra["sdpa_backend"] = "default (flash where it applies)"


def graph_time(row: Row, call: Callable[[], Any], args: argparse.Namespace) -> None:
    """Device time of one planned prefill step, replayed from a graph (the executor runs
    prefill attention eagerly; this separates the kernels from the host's launch cost)."""
    try:
        row.graph_us = time_graph(call, args.warmup, args.iters)
    except Exception as exc:
        row.extra["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]


def canonical_rows() -> list[Row]:
    """Every row, in table order."""
    rows = []
    for table in DECODE_TABLES:
        for batch in DECODE_BATCHES:
            case = f"b{batch} ctx{DECODE_CONTEXT} table{table}"
            for runner in ("reference", "triton-decode"):
                rid = f"decode/b{batch}/t{table}/{runner}"
                rows.append(Row(rid, "decode", case, runner))
    for case, (ql, _) in PREFILL_CASES.items():
        runners = ["sdpa", "triton-prefill"] + (["sdpa-dense"] if len(ql) == 1 else [])
        for runner in runners:
            if runner == "sdpa-dense" and "ctx" in case:
                continue
            rows.append(Row(f"prefill/{case}/{runner}", "prefill", case, runner))
    return rows


def all_rows() -> list[Row]:
    """Every row, in run order: torch-only rows first, so a Triton failure cannot hide them."""
    return sorted(canonical_rows(), key=lambda r: r.runner.startswith("triton"))


def run_row(row: Row, args: argparse.Namespace) -> None:
    """Fill `row`, or record why it could not be measured."""
    try:
        if row.kind == "decode":
            _, batch, table, _ = row.id.split("/")
            decode_row(row, int(batch[1:]), int(table[1:]), args)
        else:
            prefill_row(row, row.case, args)
        torch.cuda.synchronize()
    except Exception as exc:  # one row's failure must not hide the others
        row.error = f"{type(exc).__name__}: {exc}".strip()[:500]
        if args.verbose:
            traceback.print_exc()
    finally:
        torch.cuda.empty_cache()


def sticky(error: str | None) -> bool:
    """Whether the CUDA context is lost after this error (later kernels would all fail)."""
    words = (
        "illegal memory access",
        "unspecified launch failure",
        "device-side assert",
        "illegal instruction",
        "misaligned address",
        "CUDA error: an illegal",
    )
    return bool(error) and any(w in error for w in words)  # type: ignore[operator]


def run_isolated(row: Row, args: argparse.Namespace) -> Row:
    """Measure one row in a fresh process (after the context was lost here)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "row.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--only",
            row.id,
            "--json",
            path,
            "--warmup",
            str(args.warmup),
            "--iters",
            str(args.iters),
            "--quiet",
        ]
        try:
            subprocess.run(cmd, timeout=args.row_timeout, check=False)
            with open(path) as f:
                return Row(**json.load(f)["rows"][0])
        except Exception as exc:
            row.error = f"isolated run failed: {type(exc).__name__}: {exc}"[:500]
            return row


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = f"unavailable: {exc}"
    env["device"] = torch.cuda.get_device_name()
    env["shapes"] = {
        "q_heads": HQ,
        "kv_heads": HKV,
        "head_dim": DIM,
        "block_size": BLOCK,
        "dtype": str(DTYPE),
        "graph_calls": GRAPH_CALLS,
    }
    return env


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(rows: list[Row]) -> None:
    head = f"{'kind':8} {'case':28} {'runner':15} {'eager us':>10} {'graph us':>10} "
    print(head + f"{'plan us':>9} {'max err':>9}  note")
    order = {r.id: i for i, r in enumerate(canonical_rows())}
    for r in sorted(rows, key=lambda r: order.get(r.id, 0)):
        note = r.error or ""
        print(
            f"{r.kind:8} {r.case:28} {r.runner:15} {fmt(r.eager_us):>10} {fmt(r.graph_us):>10} "
            f"{fmt(r.plan_us):>9} {fmt(r.max_abs_err, 4):>9}  {note}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--only", action="append", help="row ids (or substrings) to run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--row-timeout", type=float, default=300.0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU; torch.cuda.is_available() is False.")
        return 2
    rows = [r for r in all_rows() if not args.only or any(o in r.id for o in args.only)]
    lost = False
    for i, row in enumerate(rows):
        if lost:
            rows[i] = run_isolated(row, args)
        else:
            run_row(row, args)
            lost = sticky(row.error)
        if not args.quiet:
            r = rows[i]
            print(
                f"  {r.id}: eager {fmt(r.eager_us)} us, graph {fmt(r.graph_us)} us"
                + (f"  [{r.error}]" if r.error else ""),
                flush=True,
            )
    if not args.quiet:
        print_table(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {"environment": environment(), "rows": [asdict(r) for r in rows]}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
